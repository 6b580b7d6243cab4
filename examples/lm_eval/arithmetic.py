"""Loads ``arithmetic.jsonl`` (beside this file) for the ``flyspec_arithmetic`` lm-eval task."""

import json
from pathlib import Path

import datasets


def load(**_metadata):
    """The task's one split; lm-eval passes the task metadata, which this task does not need."""
    lines = (Path(__file__).with_name("arithmetic.jsonl")).read_text().splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}
