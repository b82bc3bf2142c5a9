"""Regenerate `partrain/blueprint/hf_facts.json` from the installed transformers:

    python -m partrain.models.facts_snapshot

The snapshot lets the torch-free blueprint read HF config classes' fields without importing
transformers (which imports torch); a test checks it against the installed transformers.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from partrain.blueprint.model_facts import SNAPSHOT_PATH


def live_class_fields(arch: str) -> dict:
    """Fields, JSON-able defaults and attribute map of the installed transformers config class."""
    import dataclasses

    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[arch]
    defaults: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            value = None
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        defaults[f.name] = value
    return {"class": cls.__name__, "defaults": defaults, "attribute_map": dict(cls.attribute_map)}


def write_snapshot() -> None:
    """hf_facts.json: the config classes of the verified families and of those the generic-path survey
    finds (models/generic_survey.py), and the list of the latter."""
    import transformers

    from partrain.blueprint.families import VERIFIED
    from partrain.blueprint.families.generic import GENERIC_KEY, NOT_GENERIC_KEY
    from partrain.models.generic_survey import survey

    generic, not_generic = survey(tuple(VERIFIED))
    data: Dict[str, Any] = {"transformers_version": transformers.__version__, GENERIC_KEY: generic}
    data[NOT_GENERIC_KEY] = not_generic
    data.update({arch: live_class_fields(arch) for arch in (*VERIFIED, *generic)})
    SNAPSHOT_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_snapshot()
    print(f"wrote {SNAPSHOT_PATH}")
