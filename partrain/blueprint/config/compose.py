"""Compose a run config with Hydra: config tree + recipe + command-line overrides -> typed RunConfig.

Every failure becomes a ConfigError naming the key, so the CLI can exit 2 with one clear line.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path
from typing import List, Sequence, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException, ValidationError

from partrain.blueprint.config.local_gpus import NO_GPUS, LocalGpus, local_gpu_cluster
from partrain.blueprint.config.names import nearest_key, nearest_name
from partrain.blueprint.config.paths import conf_dir
from partrain.blueprint.config.pretrained import take_pretrained_as_is
from partrain.blueprint.config.recipes import find_recipe
from partrain.blueprint.config.schema import AT_LEAST, CHOICES, RunConfig
from partrain.errors import ConfigError, Problem

GROUPS = ("model", "cluster", "parallel", "data", "optim", "train", "checkpoint", "peft")
RECIPE_GROUP = "recipe"


def valid_values(key: str, type_name: str) -> str:
    """What a key accepts, in words: its choices, its range, or its type."""
    if key in CHOICES:
        values = [str(v) for v in CHOICES[key]]
        if all(isinstance(v, int) for v in CHOICES[key]) and len(values) > 2:
            return f"an integer {values[0]}..{values[-1]}"
        return "one of " + ", ".join(values)
    words = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
    text = words.get(type_name, f"a value of type {type_name}")
    if key in AT_LEAST:
        text += f" >= {AT_LEAST[key]}"
    return text


def _parse_overrides(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as exc:  # OverrideParseException and raw grammar errors
            key = text.split("=", 1)[0] if "=" in text else text
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "cannot parse"
            raise ConfigError(
                Problem(
                    key or text,
                    text,
                    f"malformed override ({reason})",
                    "write key=value, e.g. parallel.tp=4 or model=llama-tiny; quote values with spaces",
                )
            )
    return parsed


def _raw_value(text: str) -> str:
    return text.split("=", 1)[1] if "=" in text else ""


def _known_keys(node, prefix: str = "") -> List[str]:
    keys = []
    if isinstance(node, (dict, DictConfig)):
        for k in node:
            full = f"{prefix}.{k}" if prefix else str(k)
            keys.append(full)
            keys.extend(_known_keys(node[k], full) if str(k) != "config" else [])
    return keys


def _is_schema_key(dotted: str) -> bool:
    """Whether a dotted key names a field of the schema; any key inside the free-form `model.config`
    counts (it is checked against the HF config class later)."""
    node: object = RunConfig()
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if parts[:i] == ["model", "config"]:
            return True
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def _for_hydra(text: str, ov) -> str:
    """Let `group.key=value` set any schema key, also one the group's YAML file leaves at its default
    (Hydra's struct mode would demand `+` for those). Unknown keys are left for Hydra to refuse."""
    plain = not (ov.is_add() or ov.is_force_add() or ov.is_delete()) and ov.package is None
    return "++" + text.lstrip() if plain and "." in ov.key_or_group and _is_schema_key(ov.key_or_group) else text


def _group_options(group: str) -> List[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _load_recipe(name: str, recipe_dirs: Sequence[str | Path]) -> Tuple[dict, Path]:
    recipe = find_recipe(name, recipe_dirs)
    try:
        body = yaml.safe_load(recipe.path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            Problem("recipe", name, f"{recipe.path} is not valid YAML ({str(exc).splitlines()[0]})", "fix the file")
        )
    if not isinstance(body, dict):
        raise ConfigError(
            Problem("recipe", name, f"{recipe.path} must hold a mapping", "see docs/configuration.md#recipes")
        )
    body.pop("description", None)
    return body, recipe.path


def compose(overrides: Sequence[str], recipe_dirs: Sequence[str | Path] = (), gpus: LocalGpus = NO_GPUS) -> RunConfig:
    """Compose and type-check. Raises ConfigError; never another exception for bad input.

    `gpus`: the GPUs of the machine the command runs on (the CLI asks nvidia-smi); with any, the default
    CPU cluster becomes those GPUs (config/local_gpus.py). NO_GPUS composes what the files say."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
    )

    parsed = _parse_overrides(overrides)
    recipe_name = _check_overrides(parsed)
    _refuse_repeated_choices(parsed)
    store = ConfigStore.instance()
    body: dict = {}
    if recipe_name:
        body, path = _load_recipe(recipe_name, recipe_dirs)
        body = _without_machine_pins(body, parsed)
        store.store(group=RECIPE_GROUP, name=recipe_name, node=body, package="_global_", provider=str(path))
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=[_for_hydra(t, ov) for t, ov in zip(overrides, parsed)])
    except MissingConfigException as exc:
        raise ConfigError(_missing_option_problem(exc, parsed, recipe_name))
    except ConfigCompositionException as exc:
        raise ConfigError(_composition_problem(exc, parsed, recipe_name))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(
            Problem(
                RECIPE_GROUP if recipe_name else "overrides",
                recipe_name or " ".join(overrides),
                str(exc).splitlines()[0],
                "check the recipe's defaults list and the overrides",
            )
        )
    finally:
        if recipe_name:
            store.repo.get(RECIPE_GROUP, {}).pop(f"{recipe_name}.yaml", None)
    _backend_follows_device(cfg, parsed, body)
    _default_cluster_on_gpus(cfg, parsed, body, gpus)
    return take_pretrained_as_is(_typed(cfg, recipe_name), _explicit_model_keys(parsed, body))


DEVICE_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
"""The backend a device named on the command line brings with it (unless the backend is named too)."""


def _without_machine_pins(body: dict, parsed) -> dict:
    """A recipe describes a layout, not a machine: a cluster group named on the command line
    (`cluster=h100x8`) replaces the recipe's `cluster:` keys too, so the cluster the user names is
    the cluster that runs (`cluster.KEY=...` overrides always beat the recipe)."""
    named = any(ov.key_or_group.lstrip("+") == "cluster" for ov in parsed)
    if not named or not isinstance(body.get("cluster"), dict):
        return body
    return {k: v for k, v in body.items() if k != "cluster"}


def _backend_follows_device(cfg: DictConfig, parsed, recipe_body: dict) -> None:
    """`cluster.device=cuda` on the command line or in a recipe means nccl, `cluster.device=cpu` gloo,
    unless `cluster.backend` is named there too: a CPU cluster's gloo silently kept for GPUs would move
    every collective through host memory. cuda with gloo happens only where both are named."""
    typed = {ov.key_or_group.lstrip("+"): ov.value() for ov in parsed}
    pinned = recipe_body.get("cluster") if isinstance(recipe_body.get("cluster"), dict) else {}
    device = typed.get("cluster.device", pinned.get("device"))
    backend_named = "cluster.backend" in typed or ("backend" in pinned and "cluster.device" not in typed)
    if device in DEVICE_BACKENDS and not backend_named and OmegaConf.select(cfg, "cluster") is not None:
        with open_dict(cfg):
            cfg.cluster.backend = DEVICE_BACKENDS[device]


def _default_cluster_on_gpus(cfg: DictConfig, parsed, recipe_body: dict, gpus: LocalGpus) -> None:
    """On a machine with GPUs, the default cluster (local-cpu, from config.yaml or a recipe built on it)
    becomes them: local_gpus.local_gpu_cluster, and where neither the recipe nor the command line gives the
    process count or the batch, the global batch scales with the process count. Left as composed when a
    cluster group, `cluster.device` or `cluster.backend` is named on the command line (the user chose), or
    the recipe names a device."""
    named = {ov.key_or_group.lstrip("+") for ov in parsed}
    pinned = recipe_body.get("cluster") if isinstance(recipe_body.get("cluster"), dict) else {}
    cluster = OmegaConf.select(cfg, "cluster")
    if gpus.count == 0 or cluster is None or named & {"cluster", "cluster.device", "cluster.backend"}:
        return
    if cluster.get("name") != "local-cpu" or cluster.get("device") != "cpu" or "device" in pinned:
        return
    count_given = "cluster.devices_per_node" in named or "devices_per_node" in pinned
    cpu_processes = cluster.get("devices_per_node")
    with open_dict(cfg):
        for key, value in local_gpu_cluster(dict(cluster), gpus, count_given).items():
            if f"cluster.{key}" not in named:  # a key the command line sets keeps its value
                cfg.cluster[key] = value
        batch_given = named & {"train.global_batch_size", "train.micro_batch_size"} or {
            "global_batch_size",
            "micro_batch_size",
        } & set(recipe_body.get("train") or {})
        processes = cfg.cluster.devices_per_node
        if not count_given and not batch_given and cfg.train.global_batch_size % cpu_processes == 0:
            # The default batch is per process as much as global: one process per GPU keeps each
            # process's share, so the default run is valid on any number of GPUs.
            cfg.train.global_batch_size = cfg.train.global_batch_size // cpu_processes * processes


def _check_overrides(parsed) -> str:
    """Refuse what no override may do (delete keys, set Hydra's own settings, name an unknown top-level
    key, choose an empty group); the recipe named, or ""."""
    recipe_name = ""
    for ov in parsed:
        if ov.is_delete():
            raise ConfigError(
                Problem(
                    ov.key_or_group,
                    _raw_value(ov.input_line),
                    "deleting keys (~key) is not allowed",
                    "override the value instead",
                )
            )
        if ov.key_or_group in GROUPS + (RECIPE_GROUP,) and not (isinstance(ov.value(), str) and ov.value()):
            group = ov.key_or_group
            options = (
                "see `partrain recipes`"
                if group == RECIPE_GROUP
                else f"choose one of {', '.join(_group_options(group))}"
            )
            raise ConfigError(Problem(group, ov.value(), f"must name one {group} config", options))
        if ov.key_or_group == RECIPE_GROUP:
            recipe_name = ov.value()
        elif ov.key_or_group.split(".")[0] == "hydra":
            raise ConfigError(
                Problem(
                    ov.key_or_group,
                    _raw_value(ov.input_line),
                    "partrain does not use Hydra's own settings (hydra.*): it would be silently ignored",
                    "drop it",
                )
            )
        elif ov.key_or_group.split(".")[0] not in GROUPS:
            close = difflib.get_close_matches(ov.key_or_group.split(".")[0], GROUPS + (RECIPE_GROUP,), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                Problem(
                    ov.key_or_group,
                    _raw_value(ov.input_line),
                    "not a config key",
                    f"{hint}top-level keys are {', '.join(GROUPS + (RECIPE_GROUP,))}",
                )
            )
    return recipe_name


def _explicit_model_keys(parsed, recipe_body: dict) -> List[str]:
    """Dotted `model.` keys the command line or the recipe set by name (not through a model group):
    the ones that still apply over a pretrained folder's own config."""
    keys = [ov.key_or_group.lstrip("+") for ov in parsed if ov.key_or_group.lstrip("+").startswith("model.")]
    model = recipe_body.get("model") if isinstance(recipe_body.get("model"), dict) else {}
    for key, value in model.items():
        if key == "config" and isinstance(value, dict):
            keys += [f"model.config.{k}" for k in value]
        else:
            keys.append(f"model.{key}")
    # `model.config.rope_scaling.factor=2` sets model.config.rope_scaling (the HF config key).
    return [".".join(k.split(".")[:3]) if k.startswith("model.config.") else k for k in keys]


def _refuse_repeated_choices(parsed) -> None:
    """A recipe or config group chosen twice with different values (`recipe=a recipe=b`) is refused:
    one of the two choices would be dropped silently. Plain keys given twice keep Hydra's rule, the
    later value wins (partrain.testing.parity appends its reference overrides that way)."""
    chosen: dict = {}
    for ov in parsed:
        key = ov.key_or_group.lstrip("+")
        if key not in GROUPS + (RECIPE_GROUP,):
            continue
        first = chosen.setdefault(key, ov.value())
        if first != ov.value():
            raise ConfigError(
                Problem(
                    key,
                    ov.value(),
                    f"chosen twice on the command line ({key}={first} and {key}={ov.value()}); only one can apply",
                    f"keep one {key}=... override",
                )
            )


def _missing_option_problem(exc, parsed, recipe_name: str) -> Problem:
    text = str(exc)
    for ov in parsed:
        group = ov.key_or_group.lstrip("+")
        if group in GROUPS and f"{group}/" in text or f"'{group}'" in text:
            options = _group_options(group)
            value = ov.value()
            close = nearest_name(value, options)
            hint = f"did you mean {group}={close}? " if close else ""
            return Problem(group, value, f"no {group} config of that name", f"{hint}choose one of {', '.join(options)}")
    if recipe_name:
        return Problem(
            RECIPE_GROUP, recipe_name, text.splitlines()[0], "check the group options in the recipe's defaults list"
        )
    return Problem("defaults", "", text.splitlines()[0], "check the group names in the defaults list")


def _composition_problem(exc, parsed, recipe_name: str) -> Problem:
    text = str(exc)
    for ov in parsed:
        if f"'{ov.key_or_group}'" in text or ov.input_line in text:
            parent, _, leaf = ov.key_or_group.lstrip("+").rpartition(".")
            siblings = [k.rpartition(".")[2] for k in _known_keys(_schema()) if k.rpartition(".")[0] == parent]
            close = nearest_key(leaf, siblings)
            hint = (
                f"did you mean {parent + '.' if parent else ''}{close}?"
                if close
                else f"known keys here: {', '.join(siblings)}"
                if siblings
                else "see `partrain show --explain` for every key"
            )
            if "not in struct" in text or "Could not override" in text:
                return Problem(ov.key_or_group, ov.value(), "not a config key", hint)
            if "Could not append" in text or "already" in text:
                return Problem(
                    ov.key_or_group,
                    ov.value(),
                    "key already exists: drop the '+'",
                    f"write {ov.key_or_group.lstrip('+')}=...",
                )
            return Problem(ov.key_or_group, ov.value(), text.splitlines()[-1], hint)
    if recipe_name:
        return Problem(RECIPE_GROUP, recipe_name, text.splitlines()[0], "check the recipe's defaults list")
    return Problem("overrides", "", text.splitlines()[0], "check the overrides")


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """RunConfig as an OmegaConf schema, built once a process: only read (OmegaConf.merge copies its
    first argument), and building it took 0.1-0.15 s of every compose and every worker's config read."""
    return OmegaConf.structured(RunConfig)


def _typed(cfg: DictConfig, recipe_name: str) -> RunConfig:
    """Merge the untyped composition into the schema: unknown keys and wrong types are errors."""
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # a broken ${...} interpolation
        key = getattr(exc, "full_key", "") or "config"
        raise ConfigError(
            Problem(
                key,
                _lookup(OmegaConf.to_container(cfg, resolve=False), key),
                f"cannot resolve ({str(exc).splitlines()[0]})",
                "give a plain value or a valid ${...} reference",
            )
        )
    raw.pop("hydra", None)
    raw["recipe"] = recipe_name
    schema = _schema()
    problems = []
    _check_keys(raw, schema, "", problems)
    if problems:
        raise ConfigError(problems)
    try:
        merged = OmegaConf.merge(schema, raw)
        return OmegaConf.to_object(merged)
    except ValidationError as exc:
        key = getattr(exc, "full_key", "") or "config"
        value = _lookup(raw, key)
        expected = getattr(exc, "msg", str(exc)).splitlines()[0]
        raise ConfigError(
            Problem(
                key,
                value,
                f"wrong type ({expected}); {key} takes {valid_values(key, _field_type(key))}",
                "give a value of the documented type (see `partrain show --explain`)",
            )
        )
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or "config"
        raise ConfigError(Problem(key, _lookup(raw, key), str(exc).splitlines()[0], "see `partrain show --explain`"))


def _field_type(dotted: str) -> str:
    """The schema's type name of a dotted key ('int', 'float', ...; '' when it is not a schema field)."""
    node: object = RunConfig()
    found = ""
    for part in dotted.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return ""
        found = str(fields[part].type)  # the schema's annotations are strings (postponed evaluation)
        node = getattr(node, part)
    return found


def _lookup(raw: dict, dotted: str):
    node = raw
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _check_keys(raw, schema, prefix: str, problems: list) -> None:
    """Unknown keys anywhere except inside free-form dicts (model.config)."""
    if not isinstance(raw, dict) or not isinstance(schema, DictConfig):
        return
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in schema:
            known = list(schema.keys())
            close = nearest_key(str(key), known)
            hint = (
                f"did you mean {prefix + '.' if prefix else ''}{close}?"
                if close
                else f"known keys here: {', '.join(map(str, known))}"
            )
            problems.append(Problem(full, value, "not a config key", hint))
            continue
        if full == "model.config":
            continue
        child = schema._get_node(key)
        if isinstance(child, DictConfig) and child._metadata.object_type not in (None, dict):
            _check_keys(value, child, full, problems)


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def load_resolved(path: str | Path) -> RunConfig:
    """Read a resolved config.yaml (what workers do; no Hydra involved)."""
    raw = OmegaConf.load(str(path))
    return OmegaConf.to_object(OmegaConf.merge(_schema(), raw))
