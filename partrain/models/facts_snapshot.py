"""Regenerate `partrain/blueprint/hf_facts.json` from the installed transformers:

    python -m partrain.models.facts_snapshot

The snapshot lets the torch-free blueprint read HF config classes' fields without importing
transformers (which imports torch); a test checks it against the installed transformers.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from partrain.blueprint.model_facts import SNAPSHOT_PATH
from partrain.models.generic_survey import live_class_fields

__all__ = ["live_class_fields", "write_snapshot"]


def write_snapshot() -> None:
    """hf_facts.json: the config classes of the verified families and of those the generic-path surveys
    find (models/generic_survey.py, models/generic_moe_survey.py), and the lists of the latter."""
    import transformers

    from partrain.blueprint.families import VERIFIED
    from partrain.blueprint.families.generic import GENERIC_KEY, NOT_GENERIC_KEY
    from partrain.blueprint.families.generic_moe import GENERIC_MOE_KEY, NOT_GENERIC_MOE_KEY
    from partrain.blueprint.families.generic_template import NOT_TEMPLATE_KEY, TEMPLATE_KEY
    from partrain.models.generic_moe_survey import moe_survey
    from partrain.models.generic_survey import survey
    from partrain.models.generic_template_survey import template_survey

    generic, not_generic = survey(tuple(VERIFIED))
    moe, not_moe = moe_survey(sorted(not_generic))
    template, not_template = template_survey(sorted(a for a in not_generic if a not in moe and a not in not_moe))
    data: Dict[str, Any] = {"transformers_version": transformers.__version__, GENERIC_KEY: generic}
    data[NOT_GENERIC_KEY] = {arch: why for arch, why in not_generic.items() if arch not in moe and arch not in template}
    data[GENERIC_MOE_KEY] = {arch: record.to_json() for arch, record in moe.items()}
    data[NOT_GENERIC_MOE_KEY] = not_moe
    data[TEMPLATE_KEY] = {arch: record.to_json() for arch, record in template.items()}
    data[NOT_TEMPLATE_KEY] = not_template
    data.update({arch: live_class_fields(arch) for arch in (*VERIFIED, *generic, *moe, *template)})
    SNAPSHOT_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_snapshot()
    print(f"wrote {SNAPSHOT_PATH}")
