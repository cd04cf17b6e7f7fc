"""Read a JSONL file, validate it (structure, then token lengths) and tokenize it, before any training.

Every problem carries its 1-based line number, so one failed job tells the user everything to fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.dataset_format import DEFAULT_MAX_PROBLEMS, DEFAULT_MIN_EXAMPLES, DatasetProblem, DatasetValidator
from trainer.errors import InvalidTrainingData
from trainer.tokenize import TokenizedExample, TokenizedPair, tokenize_example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class PreparedDataset:
    """Tokenized examples (preference pairs for a ``preference`` file) in file order, with the line each came
    from."""

    format: str
    examples: list[TokenizedExample] | list[TokenizedPair]
    lines: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens the model reads in one pass over the data (what an epoch trains on)."""
        return sum(e.num_tokens for e in self.examples)


def prepare_dataset(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    min_examples: int = DEFAULT_MIN_EXAMPLES,
    max_problems: int = DEFAULT_MAX_PROBLEMS,
    param: str = "training_file",
) -> PreparedDataset:
    """Validate and tokenize ``path``; raises ``InvalidTrainingData`` listing every problem by line."""
    validator = DatasetValidator(min_examples=min_examples, max_problems=max_problems)
    examples: list[TokenizedExample | TokenizedPair] = []
    lines: list[int] = []
    length_problems: list[DatasetProblem] = []
    with open(path, "rb") as f:
        for line, raw in enumerate(f, start=1):
            example = validator.feed(raw)
            if example is None:
                continue
            try:
                tokenized = tokenize_example(tokenizer, example, validator.report.format or "")
            except ValueError as exc:
                length_problems.append(DatasetProblem(line, str(exc)))
                continue
            length = tokenized.longest if isinstance(tokenized, TokenizedPair) else tokenized.num_tokens
            if length > max_seq_len:
                length_problems.append(
                    DatasetProblem(
                        line,
                        f"example is {length} tokens, longer than max_seq_len {max_seq_len}; "
                        "shorten it or raise max_seq_len",
                    )
                )
                continue
            examples.append(tokenized)
            lines.append(line)
    report = validator.finish()
    if length_problems:
        # Merge in line order and keep the validator's cap, so the message reads top to bottom.
        merged = sorted([*report.problems, *length_problems], key=lambda p: p.line)
        report.problems = merged[:max_problems]
        report.more_problems += len(merged) - len(report.problems)
    if not report.ok:
        raise InvalidTrainingData(report, param=param)
    assert report.format is not None  # a report with examples and no problems has a format
    return PreparedDataset(report.format, examples, lines)  # type: ignore[arg-type]  # one kind per format
