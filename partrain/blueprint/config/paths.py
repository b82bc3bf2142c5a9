"""Where the shipped config tree and recipes are, in a source checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2]
"""The installed `partrain` package folder (this file is partrain/blueprint/config/paths.py)."""


def _first_existing(*candidates: Path) -> Path:
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        f"partrain's config files are missing (looked in {', '.join(map(str, candidates))}); reinstall partrain"
    )


def conf_dir() -> Path:
    """The Hydra config tree: `partrain/_conf` in a wheel, `conf/` at the top of a checkout."""
    return _first_existing(PACKAGE_DIR / "_conf", PACKAGE_DIR.parent / "conf")


def shipped_recipes_dir() -> Path:
    return _first_existing(PACKAGE_DIR / "_recipes", PACKAGE_DIR.parent / "recipes")
