"""Hugging Face Hub ids for model.pretrained, data.tokenizer and data.source, resolved to local folders.

`model.pretrained=gpt2`, `model.pretrained=org/name@v1.0` (a branch, tag or commit after `@`),
`data.tokenizer=org/name`, `data.source=org/dataset`: a value that is not an existing path and
reads as a Hub id is resolved by `huggingface_hub.snapshot_download` into the Hub cache, which
honours HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE=1 (then only the cache is read: a
`models--org--name/snapshots/<commit>` folder and its `refs/<revision>`). The value is replaced by
the snapshot folder before the config is validated, so everything downstream (validation, the
workers, checkpoints) sees a local folder whose path pins the commit; `hub_record` reads the
repo and commit back from those paths for the run folder's `hub.json`.

Resolution is in two steps: `resolve_hub_ids` (every command that composes a config: show, plan,
train) fetches only config and tokenizer files; `fetch_weights` (train's preflight only) then
fetches the model's safetensors, so planning a 70B model by id downloads kilobytes, not its
weights. A missing id, revision or cache entry is a ConfigError (exit 2) naming the key.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from partrain.blueprint.config.hub_ids import reads_as_hub_id
from partrain.blueprint.config.pretrained import adopt_pretrained
from partrain.blueprint.config.schema import RunConfig
from partrain.errors import ConfigError, Problem

CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""Files of a model repo that config validation and the tokenizer need (no weights)."""
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
DATASET_PATTERNS = ["*.parquet", "*.arrow", "*.jsonl", "*.json", "*.txt", "*.md", "*.csv"]

_SNAPSHOT = re.compile(r"/(models|datasets)--([^/]+)/snapshots/([0-9a-f]{40})(/|$)")


def hub_id(spec: Optional[str]) -> Optional[Tuple[str, Optional[str]]]:
    """(repo id, revision or None) when `spec` reads as a Hub id and is not an existing path; else None."""
    if not spec or spec in ("builtin", "builtin-chat", "builtin-preference", "byte", "auto") or _exists(spec):
        return None
    if not reads_as_hub_id(spec):
        return None
    repo, _, revision = spec.partition("@")
    return repo, revision or None


def _exists(spec: str) -> bool:
    try:
        return Path(spec).expanduser().exists()
    except OSError:  # a name too long for the file system: not a path here (preflight names the limit)
        return False


def _download(repo: str, revision: Optional[str], repo_type: str, patterns: List[str]) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, repo_type=repo_type, revision=revision, allow_patterns=patterns)


def _problem(key: str, spec: str, repo_type: str, exc: Exception) -> Problem:
    from huggingface_hub import constants

    name = type(exc).__name__
    if constants.HF_HUB_OFFLINE:
        rule = (
            f"not a local folder, and HF_HUB_OFFLINE=1 with no cached snapshot of this {repo_type} "
            f"in {constants.HF_HUB_CACHE} ({name})"
        )
        fix = "download it once online (unset HF_HUB_OFFLINE), point HF_HOME at the cache holding it, or give a folder"
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else name
        rule = f"not a local folder, and the Hub has no such {repo_type} (or revision): {first[:200]}"
        fix = "check the id and the revision after '@' (e.g. org/name@main), or give a local folder"
    return Problem(key, spec, rule, fix)


def resolve(spec: str, key: str, repo_type: str, patterns: List[str]) -> str:
    """The local folder for `spec` (itself when it is not a Hub id); ConfigError naming `key`."""
    parsed = hub_id(spec)
    if parsed is None:
        return spec
    try:
        return _download(parsed[0], parsed[1], repo_type, patterns)
    except Exception as exc:  # noqa: BLE001 - huggingface_hub raises many types (HTTP, offline, validation)
        raise ConfigError(_problem(key, spec, repo_type, exc)) from None


def resolve_hub_ids(run: RunConfig, fetch_data: bool = True) -> RunConfig:
    """The run with Hub ids in model.pretrained, data.tokenizer and data.source replaced by local
    snapshot folders (config and tokenizer files only; see fetch_weights). Every failing key is
    reported at once. fetch_data=False (a dry run, `plan`): a Hub dataset is taken from the local
    Hub cache only, and left as the id when it is not there (the preflight names it unchecked)."""
    problems: List[Problem] = []
    values: Dict[str, Optional[str]] = {}
    for key, spec, repo_type, patterns in (
        ("model.pretrained", run.model.pretrained, "model", CONFIG_PATTERNS),
        ("data.tokenizer", run.data.tokenizer, "model", CONFIG_PATTERNS),
        ("data.source", run.data.source, "dataset", DATASET_PATTERNS),
    ):
        try:
            if key == "data.source" and not fetch_data:
                values[key] = cached(spec, repo_type, patterns)
                continue
            values[key] = resolve(spec, key, repo_type, patterns) if spec else spec
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    model = dataclasses.replace(run.model, pretrained=values["model.pretrained"])
    data = dataclasses.replace(run.data, tokenizer=values["data.tokenizer"], source=values["data.source"])
    # A Hub model is a folder only now: its arch and, with data.tokenizer=auto, its tokenizer follow it.
    return adopt_pretrained(dataclasses.replace(run, model=model, data=data))


def cached(spec: str, repo_type: str, patterns: List[str]) -> str:
    """The snapshot folder of `spec` already in the local Hub cache, else `spec` as it is; downloads nothing."""
    parsed = hub_id(spec)
    if parsed is None:
        return spec
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            parsed[0], repo_type=repo_type, revision=parsed[1], allow_patterns=patterns, local_files_only=True
        )
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub raises several types for that)
        return spec


def snapshot_of(folder: Optional[str]) -> Optional[Dict[str, str]]:
    """{repo, repo_type, commit, folder} when `folder` lies in a Hub cache snapshot; else None."""
    if not folder:
        return None
    found = _SNAPSHOT.search(str(Path(folder).expanduser().resolve()) + "/")
    if found is None:
        found = _SNAPSHOT.search(str(Path(folder).expanduser()) + "/")
    if found is None:
        return None
    kind, name, commit = found.groups()[:3]
    return {"repo": name.replace("--", "/"), "repo_type": kind[:-1], "commit": commit, "folder": str(folder)}


def fetch_weights(run: RunConfig) -> List[Problem]:
    """train's preflight: the safetensors of a Hub model.pretrained, at the commit already resolved."""
    snap = snapshot_of(run.model.pretrained)
    if snap is None or snap["repo_type"] != "model":
        return []
    try:
        _download(snap["repo"], snap["commit"], "model", WEIGHT_PATTERNS)
    except Exception as exc:  # noqa: BLE001
        return [_problem("model.pretrained", run.model.pretrained, "model", exc)]
    return []


def hub_record(run: RunConfig) -> Dict[str, Dict[str, str]]:
    """What the run folder's hub.json records: key -> {repo, repo_type, commit, folder} for every
    value that is a Hub cache snapshot (the resolved revision is its commit hash)."""
    out = {}
    for key, value in (
        ("model.pretrained", run.model.pretrained),
        ("data.tokenizer", run.data.tokenizer),
        ("data.source", run.data.source),
    ):
        snap = snapshot_of(value)
        if snap is not None:
            out[key] = snap
    return out
