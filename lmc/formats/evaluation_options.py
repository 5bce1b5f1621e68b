"""How ``lmc interpolate`` reads and batches its evaluation data (:class:`EvaluationDataOptions`).

Apart from :mod:`lmc.formats.evaluation_data`, which reads the data with torch: the command's --help
builds its flags from this class and loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmc.tasks import CurveSplit, check_curve_split


@dataclass(frozen=True)
class EvaluationDataOptions:
    """How the evaluation data is read and batched (``lmc interpolate``'s data flags).

    ``split`` and ``batch_size`` apply to a DataModule too; the other fields to the user's own
    data (:func:`evaluation_data`) only. The attribute docstrings are the command-line help.
    """

    split: CurveSplit = "val"
    """The split the curves are measured on (of a DataModule, or of a save_to_disk DatasetDict)."""

    batch_size: int | None = None
    """Evaluation batch size (default: the DataModule's, 32 for the user's data)."""

    text_column: str = "text"
    """The text column of the user's tables."""

    label_column: str = "label"
    """The label column of the user's tables (sequence classifiers; BERT pre-training's next-sentence
    labels of sentence pairs: 0 when the second sentence follows the first, 1 when it is random)."""

    pair_column: str = "text_pair"
    """The second-sentence column of the user's tables (BERT masked-LM and pre-training models): if the
    table has it, each row is a sentence pair, and a pre-training model's next-sentence head is scored too."""

    mask_seed: int = 0
    """The seed of BERT masked-LM evaluation's masks (15 % of the tokens; 80 % masked, 10 % random, 10 % kept),
    drawn once: every point of the curves sees the same masks."""

    sequence_length: int | None = None
    """Tokens per sequence of the user's text (windows for causal LMs, the longest text for classifiers and
    masked LMs); default 128, or the model's positions if it has fewer."""

    def __post_init__(self) -> None:
        check_curve_split(self.split)
        for name in ("batch_size", "sequence_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be positive, got {value}")
