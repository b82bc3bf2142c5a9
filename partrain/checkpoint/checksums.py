"""SHA-256 of checkpoint files: computed when they are written, checked before they are read.

Hashing streams each file in 1 MiB chunks (one read, constant memory). On a save every rank hashes
the files it wrote itself (`owned_files`: its DCP shards `__<rank>_<n>.distcp`, its
`rng/rank-<rank>.pt`, and for rank 0 DCP's `.metadata`), so no rank re-reads the whole checkpoint
on the training path; rank 0 gathers them into partrain.json. On a load the files are spread over
the ranks by size (`share`). Pure Python (hashlib), no torch.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from partrain.checkpoint.folders import METADATA_FILE, RECORD_FILE

CHUNK_BYTES = 1 << 20
ALGORITHM = "sha256"

_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
_RNG = re.compile(r"^rng/rank-(\d+)\.pt$")


def file_digest(path: Path) -> Tuple[int, str]:
    """(bytes read, hex SHA-256) of one file, read once in CHUNK_BYTES pieces."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            if not chunk:
                break
            size += len(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()


def checkpoint_files(folder: Path) -> List[str]:
    """Relative posix paths of every file of a checkpoint folder except partrain.json and temporaries."""
    folder = Path(folder)
    found = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != RECORD_FILE and not path.name.endswith(".tmp"):
            found.append(rel)
    return sorted(found)


def owned_files(files: Iterable[str], rank: int) -> List[str]:
    """The files among `files` that `rank` wrote during a save (DCP names shards by writing rank)."""
    mine = []
    for rel in files:
        shard, rng = _SHARD.match(rel), _RNG.match(rel)
        owner = int(shard.group(1)) if shard else int(rng.group(1)) if rng else 0 if rel == METADATA_FILE else None
        if owner == rank:
            mine.append(rel)
    return mine


def share(sizes: Dict[str, int], rank: int, world: int) -> List[str]:
    """This rank's part of a load-time verification: the files dealt largest first, each to the
    rank with the fewest bytes so far (the same deal on every rank, from partrain.json alone)."""
    ranks = [(0, r) for r in range(world)]  # (bytes so far, rank): a heap, so big worlds stay cheap
    mine = []
    for rel in sorted(sizes, key=lambda name: (-int(sizes[name]), name)):
        load, who = heapq.heappop(ranks)
        heapq.heappush(ranks, (load + int(sizes[rel]), who))
        if who == rank:
            mine.append(rel)
    return sorted(mine)


def digests(folder: Path, files: Iterable[str]) -> Dict[str, Tuple[int, str]]:
    """{relative path: (size, sha256)} of the given files of folder."""
    return {rel: file_digest(Path(folder) / rel) for rel in files}


def mismatch(folder: Path, rel: str, size: int, expected: Optional[str]) -> Optional[str]:
    """Why file `rel` does not match what partrain.json recorded (size, then sha256), a sentence
    naming its path, or None.

    expected None: the checkpoint has no checksums (format_version 1), only the size is checked.
    """
    path = Path(folder) / rel
    if not path.is_file():
        return f"{path} is missing from the checkpoint"
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"{path} is truncated or changed: {actual} bytes, {size} when it was saved"
        if expected is None:
            return None
        read, got = file_digest(path)
    except OSError as exc:  # unreadable (permissions, I/O error): damage for whoever needs the file
        return f"{path} cannot be read: {exc.strerror or exc}"
    if read != size or got != expected:
        return f"checksum mismatch: {path} was changed after it was saved"
    return None
