"""`partrain checkpoint verify PATH`: is a checkpoint (or each one in a folder) intact?

One process, no process group, reads every file once. For each checkpoint: partrain.json parses
and is ours; every file it lists is present with its recorded size and SHA-256 (format_version 1
checkpoints have sizes only: said so, not a failure, and instead every stored chunk must load with
torch.load(weights_only=True)); DCP's `.metadata` unpickles with the allow-list and every byte
range it indexes lies inside a listed file. A folder of checkpoints
(RUN_DIR/checkpoints) is checked one checkpoint at a time, including `step-NNNNNNNN` folders that
lack partrain.json or .metadata (damaged: resume=auto skips them); unfinished `.partial` saves are
not checkpoints and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from partrain.checkpoint import folders
from partrain.checkpoint.export import PATH_KEY
from partrain.checkpoint.failures import first_line
from partrain.checkpoint.record import file_problems, has_checksums, read_record
from partrain.errors import ConfigError, Problem


@dataclass
class Verdict:
    """What verify found in one checkpoint folder."""

    path: Path
    step: Optional[int]
    files: int = 0
    """Files listed in partrain.json (and checked)."""
    bytes: int = 0
    """Their recorded total size."""
    checksums: bool = True
    """False for a format_version 1 checkpoint: sizes were checked, contents could not be."""
    problems: List[str] = field(default_factory=list)
    """One sentence per problem, each naming the file."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> Dict[str, Any]:
        return {
            "path": str(self.path),
            "step": self.step,
            "ok": self.ok,
            "files": self.files,
            "bytes": self.bytes,
            "checksums": self.checksums,
            "problems": list(self.problems),
        }


def _index_problems(path: Path, record: Dict[str, Any]) -> Tuple[Any, List[str]]:
    """(DCP's index or None, problems): it parses, and every chunk it points at lies inside a file
    partrain.json lists."""
    from partrain.checkpoint.safe_io import read_metadata

    try:
        metadata = read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read the index means the same to the user
        return None, [f"{path / folders.METADATA_FILE} cannot be read: {first_line(exc)}"]
    problems = []
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        size = record["files"].get(rel)
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        if size is None:
            problems.append(f"{path / folders.METADATA_FILE} points {index.fqn} at {rel}, not in the checkpoint")
        elif end > int(size):
            problems.append(f"{path / rel} is shorter ({size} bytes) than the index says ({end} bytes for {index.fqn})")
        if len(problems) >= 5:
            break
    return metadata, problems


def _parse_problems(path: Path, record: Dict[str, Any], metadata: Any) -> List[str]:
    """Without checksums (format_version 1) the next best thing: every stored chunk and RNG file
    loads with torch.load(weights_only=True). Catches damaged headers, not changed numbers."""
    import io

    import torch

    from partrain.checkpoint.safe_io import load_tensors

    problems = []
    chunks: Dict[str, List[Any]] = {}
    for info in (metadata.storage_data or {}).values() if metadata is not None else []:
        chunks.setdefault(getattr(info, "relative_path", ""), []).append(info)
    for rel in record["files"]:
        file = path / rel
        try:
            if rel in chunks:
                with open(file, "rb") as f:
                    for info in chunks[rel]:
                        f.seek(info.offset)
                        torch.load(io.BytesIO(f.read(info.length)), weights_only=True, map_location="cpu")
            elif rel.endswith(".pt"):
                load_tensors(file)
        except Exception as exc:  # noqa: BLE001 - any failure to parse is damage
            problems.append(f"{file} cannot be read: {first_line(exc)}")
    return problems


def verify_checkpoint(path: Path) -> Verdict:
    """Check one checkpoint folder (see the module docstring); never raises for damage."""
    path = Path(path)
    verdict = Verdict(path=path, step=folders.step_of(path))
    try:
        record = read_record(path, key=PATH_KEY)
    except ConfigError as err:
        verdict.problems += [f"{p.value}: {p.rule}" for p in err.problems]
        return verdict
    verdict.files = len(record["files"])
    verdict.bytes = sum(int(size) for size in record["files"].values())
    verdict.checksums = has_checksums(record)
    verdict.problems += [why for _, why in file_problems(path, record)]
    if (path / folders.METADATA_FILE).is_file() or folders.METADATA_FILE not in record["files"]:
        metadata, found = _index_problems(path, record)
        verdict.problems += found
        if not verdict.checksums and not verdict.problems:
            verdict.problems += _parse_problems(path, record, metadata)
    return verdict


def verify_path(path: Path) -> List[Verdict]:
    """One Verdict for a checkpoint folder; one per step-NNNNNNNN folder (oldest first) for a folder
    of checkpoints. ConfigError (key PATH) when path is neither."""
    path = Path(path)
    fix = "pass RUN_DIR/checkpoints or one step-NNNNNNNN folder in it"
    if not path.exists():
        raise ConfigError(Problem(PATH_KEY, str(path), "no such file or folder", fix))
    if not path.is_dir():
        raise ConfigError(Problem(PATH_KEY, str(path), "is a file; a checkpoint is a folder", fix))
    if folders.step_of(path) is not None or (path / folders.RECORD_FILE).exists():
        return [verify_checkpoint(path)]
    inside = sorted((p for p in path.iterdir() if folders.step_of(p) is not None and p.is_dir()), key=folders.step_of)
    if not inside:
        rule = (
            "an unfinished save (the run stopped while writing it), not a checkpoint"
            if path.name.endswith(folders.PARTIAL_SUFFIX)
            else "neither a checkpoint (no partrain.json) nor a folder of step-NNNNNNNN checkpoints"
        )
        raise ConfigError(Problem(PATH_KEY, str(path), rule, fix))
    return [verify_checkpoint(p) for p in inside]


def report_lines(verdicts: List[Verdict]) -> List[str]:
    """What `partrain checkpoint verify` prints: each problem (naming its file), and for an intact
    checkpoint `ok: [PATH: ]N files, X MiB verified` (or `(sizes only: ...)` without checksums)."""
    lines = []
    for v in verdicts:
        lines += v.problems
        if v.ok:
            where = f"{v.path}: " if len(verdicts) > 1 else ""
            how = "verified" if v.checksums else "(sizes only: format_version 1 has no checksums)"
            lines.append(f"ok: {where}{v.files} files, {v.bytes / 2**20:.1f} MiB {how}")
    return lines


def report_json(path: Path, verdicts: List[Verdict]) -> Dict[str, Any]:
    """`--json`: {path, ok, checkpoints: [Verdict.to_json(), ...]}."""
    return {"path": str(path), "ok": all(v.ok for v in verdicts), "checkpoints": [v.to_json() for v in verdicts]}
