"""The draft-length (K) policies: how many drafts a step proposes and verifies.

- `DraftLengthPolicy` (protocol.py): what the loop asks a row's policy (next_k, keep,
  draft_reach, update, reads_tokens, shares_width).
- `StepCost` (step_cost.py): the one time model, a step's seconds as a + b·positions +
  d·drafting rows, read by one row's adaptive K and by the batch's width alike.
- `AcceptanceCurve` (curve.py): acceptance per draft position.
- Policies: `AdaptiveDraftLength` (adaptive.py), `TreeBudget` (trees.py), `ScoredDraftLength`
  and `ConfidenceDraftLength` (scored.py), `MatchLengthDraftLength`, `copier_policy` and
  `PerSourceDraftLength` (copiers.py).
- `VerifyBudget` (batch_width.py): a batch's shared width each step.

Nothing here imports the loop: policies read a draft's length and `parents` only. The design and
its measurements: docs/draft-length.md.
"""

from .adaptive import AdaptiveDraftLength
from .batch_width import VerifyBudget
from .copiers import (BUCKET_STARTS, MAX_MATCH, MatchLengthDraftLength, PerSourceDraftLength,
                      bucket_of, copier_policy)
from .curve import FIRST_PRIOR, AcceptanceCurve, conditional_from_reach, expected_tokens
from .protocol import DraftLengthPolicy
from .scored import ConfidenceDraftLength, ScoredDraftLength
from .step_cost import StepCost
from .trees import TreeBudget

__all__ = [
    "AcceptanceCurve", "AdaptiveDraftLength", "BUCKET_STARTS", "ConfidenceDraftLength",
    "DraftLengthPolicy", "FIRST_PRIOR", "MAX_MATCH", "MatchLengthDraftLength",
    "PerSourceDraftLength", "ScoredDraftLength", "StepCost", "TreeBudget", "VerifyBudget",
    "bucket_of", "conditional_from_reach", "copier_policy", "expected_tokens",
]
