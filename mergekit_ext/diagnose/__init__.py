"""``mergekit-ext diagnose``: how far merged models are from each expert, block by block.

- :mod:`~mergekit_ext.diagnose.diagnoser`: the plan (everything checked before a weight
  loads) and the passes (each task's expert and every compared model, block by block);
- :mod:`~mergekit_ext.diagnose.heldout`: which data it measures on;
- :mod:`~mergekit_ext.diagnose.agreement`: KL and top-1 agreement (pure tensor functions);
- :mod:`~mergekit_ext.diagnose.verdict`: the comparison with the base model and the experts;
- :mod:`~mergekit_ext.diagnose.report`: the terminal table, the plot, the JSON values.

See ``docs/methods.md``, "Diagnose".
"""

from mergekit_ext.diagnose.agreement import chunked_kl_top1, kl_and_agreement
from mergekit_ext.diagnose.diagnoser import (
    DiagnosisPlan,
    diagnose,
    plan_diagnosis,
    relative_error,
    summarize,
)
from mergekit_ext.diagnose.heldout import parse_heldout
from mergekit_ext.diagnose.report import format_report, format_table, jsonable, plot_block_errors
from mergekit_ext.diagnose.verdict import compare_with_references, verdict

__all__ = [
    "DiagnosisPlan",
    "chunked_kl_top1",
    "compare_with_references",
    "diagnose",
    "format_report",
    "format_table",
    "jsonable",
    "kl_and_agreement",
    "parse_heldout",
    "plan_diagnosis",
    "plot_block_errors",
    "relative_error",
    "summarize",
    "verdict",
]
