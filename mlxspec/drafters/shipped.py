"""The trained drafters that ship with mlxspec, found for a target by its sizes and checksum.

Each lives in a directory under drafters/trained/ whose target.json names the drafter kind
("dflash" when it names none), the target's (hidden, vocab, layers) and the sum of its first 8
embedding rows. Backend-neutral: a caller brings the target's `TargetSizes` and checksum.
"""

import json
from pathlib import Path

TRAINED_DIR = Path(__file__).parent / "trained"


def find_shipped_drafter(sizes: tuple, checksum, kind: str = "dflash") -> Path | None:
    """The `kind` drafter shipped for a target of these (hidden, vocab, layers) sizes whose
    embedding checksum is `checksum()` (called only when the sizes match), if any."""
    value = None
    for folder, want in shipped_candidates(sizes, kind):
        value = checksum() if value is None else value
        if abs(value - want["embedding_checksum"]) <= 1e-3 * max(1.0, abs(value)):
            return folder
    return None


def shipped_candidates(sizes: tuple, kind: str = "dflash"):
    """(directory, its target.json) of each `kind` drafter shipped for a target of these
    (hidden, vocab, layers) sizes: read before the target loads (its weights tell which)."""
    for target_file in sorted(TRAINED_DIR.glob("*/target.json")):
        want = json.loads(target_file.read_text())
        if want.get("drafter", "dflash") == kind and \
                (want["hidden_size"], want["vocab_size"], want["num_layers"]) == tuple(sizes):
            yield target_file.parent, want
