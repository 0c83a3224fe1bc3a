"""YAML files for the configuration tests (imported as `from config_files import write`; tests/ is on
sys.path, see hf_reference)."""

from __future__ import annotations

from pathlib import Path

import yaml


def write(tmp_path: Path, data: dict, name: str = "x.yaml") -> Path:
    """`data` as YAML in `tmp_path / name`; its path."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path
