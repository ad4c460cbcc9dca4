"""The `ripplemesh` command's commands, a module per command or group; `ripplemesh.cli` puts
them on its group. Each imports its heavy dependencies (torch, SQLAlchemy, the simulator) only
when it runs, so that `ripplemesh --help` stays quick."""

from __future__ import annotations

from rich.console import Console

console = Console(stderr=True)

ENGINE_CHOICES = ["sim", "hf", "vllm"]
