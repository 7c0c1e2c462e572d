"""Evaluation harness: RULER-style task generators (`tasks`), the compress-after-prefill protocol with
physical compaction (`protocol`), a resumable runner with JSON/CSV outputs (`runner`), plots (`plots`)
and the `kvp-eval` command line (`cli`)."""

from .tasks import TASKS, Sample, make_sample, score_answers  # noqa: F401
