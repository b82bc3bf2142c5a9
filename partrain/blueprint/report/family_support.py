"""What the suite has verified of this run's model family under the axes its layout uses: the cells of
the family x layout parity matrix (blueprint/families/support.py, docs/families.md) that this layout
touches, each verified alone against one process, or refused, or not in the matrix."""

from __future__ import annotations

from typing import Dict, List

from partrain.blueprint.families import GENERIC_BASE, family
from partrain.blueprint.families.generic import GENERIC_NOTE, GENERIC_PIPELINE
from partrain.blueprint.families.generic_moe import GENERIC_MOE_NOTE, GENERIC_MOE_RECORDS
from partrain.blueprint.families.generic_template import TEMPLATE_NOTE, TEMPLATE_RECORDS
from partrain.blueprint.families.support import PARITY_FAMILIES, PARITY_LAYOUTS, PARITY_REFUSED
from partrain.blueprint.validate import ValidatedRun

MOE_VERIFIED = "verified under expert parallelism and its combinations (docs/parallel/expert.md)"
"""What the report says of an MoE family: its own matrix is the expert-parallel one."""


def matrix_cells(v: ValidatedRun) -> List[str]:
    """The parity-matrix layouts that exercise what this run's layout uses (one per axis it turns on)."""
    layout, p, train = v.layout, v.run.parallel, v.run.train
    cells = []
    if layout.dp > 1:
        cells.append("fsdp2" if p.zero_stage >= 2 else "ddp2")
    if layout.tp > 1:
        cells.append("tp2-megatron-sp" if p.tp_sequence_parallel else "tp2")
    if layout.pp > 1:
        cells.append("pp2-1f1b")
    if layout.sp > 1:
        cells.append(f"sp2-{p.sp_mode}")
    if v.run.peft.method == "lora":
        cells.append("lora-tp2")
    if 0 < train.loss_chunk_tokens < train.micro_batch_size * train.seq_len:
        cells.append("pp2-chunked-loss" if layout.pp > 1 else "ddp2-chunked-loss")
    return [c for c in cells if c in PARITY_LAYOUTS]


def family_support(v: ValidatedRun) -> Dict[str, object]:
    """{"arch", "matrix": whether the family has a row, "cells": {layout: verified | refused}, "note"}."""
    arch = v.run.model.arch
    pp = ", pp" if arch in GENERIC_PIPELINE else ""
    note = GENERIC_MOE_NOTE if arch in GENERIC_MOE_RECORDS else GENERIC_NOTE if arch in GENERIC_BASE else TEMPLATE_NOTE
    tp = "" if arch in TEMPLATE_RECORDS and not TEMPLATE_RECORDS[arch].tensor_parallel else ", tp"
    generic = note.format(base=GENERIC_BASE.get(arch), pp=pp, tp=tp) if family(arch).generic else ""
    if arch not in PARITY_FAMILIES:
        return {"arch": arch, "matrix": False, "cells": {}, "note": generic or (MOE_VERIFIED if v.facts.is_moe else "")}
    cells = {c: "refused" if (arch, c) in PARITY_REFUSED else "verified" for c in matrix_cells(v)}
    return {"arch": arch, "matrix": True, "cells": cells, "note": generic}


def family_line(support: Dict[str, object]) -> str:
    """The dry run's one line for the family."""
    if not support["matrix"]:
        return f"{support['arch']}: {support['note'] or 'not in the family matrix (docs/families.md)'}"
    cells = support["cells"]
    if not cells:
        return f"{support['arch']}: verified against one process (docs/families.md); this layout uses no parallel axis"
    listed = ", ".join(f"{cell} {status}" for cell, status in cells.items())  # type: ignore[union-attr]
    path = f" ({support['note']})" if support["note"] else ""
    return (
        f"{support['arch']}{path}: each axis of this layout checked alone against one process: {listed} "
        "(docs/families.md)"
    )
