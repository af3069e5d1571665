"""The task's dataset: the JSONL beside this file, whatever the working
directory (a relative `data_files` path would be taken from the cwd)."""

from pathlib import Path

import datasets


def load_local(**kwargs):
    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).resolve().parent / "lockgate_mc.jsonl")})
