"""Recipes: named presets (YAML) that pick config groups and override values.

A recipe file looks like::

    # @package _global_
    description: one line shown by `partrain recipes`
    defaults:
      - override /model: gpt2-tiny
    parallel: {dp: 2, tp: 2}

Recipe folders are searched in order: the user's (`--recipes DIR`, then `$PARTRAIN_RECIPES`,
colon-separated) before the shipped ones, so a user's recipe wins over a shipped one of the same
name. Shadowing is reported by `partrain recipes`, never silent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

import yaml

from partrain.blueprint.config.names import nearest_name
from partrain.blueprint.config.paths import shipped_recipes_dir
from partrain.errors import ConfigError, Problem


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    shipped: bool
    shadows: Path | None = None
    """The recipe of the same name this one hides, if any."""

    @property
    def description(self) -> str:
        """The file's `description:` line, read when asked: every compose looks a recipe up, and
        parsing every recipe file for it cost more than Hydra's own loading of the one used."""
        return _description(self.path)


def recipe_dirs(user_dirs: Sequence[str | Path]) -> List[Path]:
    """User folders first, then the shipped folder."""
    dirs: List[Path] = []
    for d in user_dirs:
        path = Path(d).expanduser()
        if not path.is_dir():
            raise ConfigError(
                Problem("--recipes", str(d), "not a folder", "pass an existing folder of recipe YAML files")
            )
        dirs.append(path.resolve())
    dirs.append(shipped_recipes_dir())
    return dirs


def _description(path: Path) -> str:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "(unreadable)"
    return str(data.get("description", "")) if isinstance(data, dict) else "(not a mapping)"


def list_recipes(user_dirs: Sequence[str | Path]) -> Dict[str, Recipe]:
    dirs = recipe_dirs(user_dirs)
    shipped = dirs[-1]
    found: Dict[str, Recipe] = {}
    for folder in dirs:
        for path in sorted(folder.glob("*.yaml")) + sorted(folder.glob("*.yml")):
            name = path.stem
            if name in found:
                if found[name].shadows is None:
                    found[name] = Recipe(found[name].name, found[name].path, found[name].shipped, path)
                continue
            found[name] = Recipe(name, path, folder == shipped)
    return dict(sorted(found.items()))


def find_recipe(name: str, user_dirs: Sequence[str | Path]) -> Recipe:
    recipes = list_recipes(user_dirs)
    if name not in recipes:
        close = nearest_name(name, recipes)
        hint = f"did you mean recipe={close}? " if close else ""
        raise ConfigError(
            Problem(
                "recipe",
                name,
                "no recipe of that name",
                f"{hint}known recipes: {', '.join(recipes)} (see `partrain recipes`)",
            )
        )
    return recipes[name]
