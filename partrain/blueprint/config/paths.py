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


def is_there(path: str | Path, kind: str = "any") -> bool:
    """Whether `path` is there (kind "any", "dir" or "file"); a path the OS cannot even look up (a name
    longer than NAME_MAX, a component that is a file) is not there, rather than an OSError: the preflight
    then names the key and the limit (partrain.preflight.paths)."""
    try:
        p = Path(path).expanduser()
        return p.is_dir() if kind == "dir" else p.is_file() if kind == "file" else p.exists()
    except (OSError, ValueError):
        return False
