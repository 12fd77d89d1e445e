"""The models a decision table is made for: each its own page, figure and README summary, from the result files that
ran on it. Bytes per token are each model's packed layout; every other column is measured on that model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from bench.commands.serving_workloads import ModelShape


@dataclass(frozen=True)
class TableModel:
    name: str  # the `--model` every command takes
    title: str
    shape: ModelShape
    recorded_as: tuple[str, ...]  # what a result file records as its model: the name, the model folder's name
    docs: str  # the table's page, from the repository root
    plot: str
    readme_tag: str  # the README block's markers carry it ("" for the first model's block)
    about: str  # one sentence on the model's attention, for the page

    @property
    def heads_text(self) -> str:
        s = self.shape
        return f"{s.kv_heads} KV head{'s' * (s.kv_heads != 1)} of head_dim {s.head_dim}"

    def records(self, name: str) -> bool:
        """Whether a file's recorded model (a name or a model folder) is this one."""
        return name.lower() in self.recorded_as or PurePath(name).name.lower() in self.recorded_as


SMOLLM2 = TableModel("smollm2", "SmolLM2-135M", ModelShape(layers=30, kv_heads=3, head_dim=64, dtype="bfloat16"),
                     ("smollm2", "smollm2-135m-instruct"), "docs/decision.md", "bench/results/decision-smollm2.png",
                     "", "Every layer attends to every token; the chat model answers the needles in its template.")
GEMMA3 = TableModel("gemma3", "Gemma 3 270M", ModelShape(layers=18, kv_heads=1, head_dim=256, dtype="bfloat16"),
                    ("gemma3", "gemma-3-270m"), "docs/decision-gemma3.md", "bench/results/decision-gemma3.png",
                    "gemma3",
                    "15 of its 18 layers attend to a sliding window of 512 tokens (the attention error too: each "
                    "layer's own window), and every layer stores every token, as SGLang's own pool does for Gemma 3; "
                    "the base model has no chat template and completes the needles' \"Answer:\".")
MODELS = {m.name: m for m in (SMOLLM2, GEMMA3)}
# What a result file that records no model ran on: every command's --model default.
UNRECORDED = SMOLLM2.name
