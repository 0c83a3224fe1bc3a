"""Stand-ins for the NVIDIA tools the launcher's `gpu_share` runs: real executables in a folder the
test puts first on PATH (imported by tests as `import fake_nvidia`).

`nvidia-smi` prints the GPUs the test gave (`--query-gpu=index,uuid,compute_mode` rows).
`nvidia-cuda-mps-control` behaves as the daemon does, as far as the launcher can tell (as seen on an
H200 host with driver 580): `-d` creates `control` and `nvidia-cuda-mps-control.pid` in
$CUDA_MPS_PIPE_DIRECTORY, a command read on stdin is answered while the pid file exists, `quit`
removes the pid file (the socket files stay), `-f` stays running (a process named like an MPS
daemon). Every call appends one line to `calls.log`: its arguments or command, then the MPS
variables and CUDA_VISIBLE_DEVICES it saw.
A file named after a mode in the folder makes it misbehave: `fail-start` (`-d` exits 1), `no-answer`
(commands exit 1), `stay` (`quit` is answered but the daemon stays), `hang` (every call sleeps 30 s once recorded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CONTROL = r'''#!/bin/sh
PATH=/usr/bin:/bin
dir=$(dirname "$0")
seen="pipe=${CUDA_MPS_PIPE_DIRECTORY-unset} log=${CUDA_MPS_LOG_DIRECTORY-unset} visible=${CUDA_VISIBLE_DEVICES-unset}"
case "$1" in
  -d)
    echo "-d $seen" >> "$dir/calls.log"
    [ -e "$dir/hang" ] && exec sleep 30
    if [ -e "$dir/fail-start" ]; then echo "An instance of this daemon is already running" >&2; exit 1; fi
    touch "$CUDA_MPS_PIPE_DIRECTORY/control"
    echo 4242 > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
    exit 0 ;;
  -f)
    while :; do sleep 1; done ;;
esac
read -r line
echo "$line $seen" >> "$dir/calls.log"
[ -e "$dir/hang" ] && exec sleep 30
if [ -e "$dir/no-answer" ] || [ ! -e "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid" ]; then
  echo "Cannot find MPS control daemon process"; exit 1
fi
case "$line" in
  quit) [ -e "$dir/stay" ] || rm -f "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid" ;;
  get_default_active_thread_percentage) echo 100.0 ;;
esac
'''

SMI = r'''#!/bin/sh
PATH=/usr/bin:/bin
[ "$*" = "--query-gpu=index,uuid,compute_mode --format=csv,noheader" ] || exit 2
cat "$(dirname "$0")/gpus.csv"
'''

GPU0 = "0, GPU-4f1c7d2e-0000-1111-2222-333344445555, Default"


@dataclass
class FakeTools:
    bin: Path  # put first on PATH

    @property
    def calls_log(self) -> Path:
        return self.bin / "calls.log"

    def calls(self) -> list[str]:
        """One line per call of the control tool, in order."""
        return self.calls_log.read_text().splitlines() if self.calls_log.exists() else []

    def set_mode(self, mode: str) -> None:
        (self.bin / mode).touch()

    def path(self) -> str:
        """PATH with these tools first."""
        return os.pathsep.join([str(self.bin), os.environ.get("PATH", os.defpath)])


def install(folder: Path, gpus: list[str] | None = None, control: bool = True, smi: bool = True) -> FakeTools:
    """The tools in `folder` (made): nvidia-smi listing `gpus` (default: one GPU 0 in Default mode)."""
    folder.mkdir(parents=True, exist_ok=True)
    tools = {"nvidia-cuda-mps-control": CONTROL if control else None, "nvidia-smi": SMI if smi else None}
    for name, text in tools.items():
        if text is not None:
            (folder / name).write_text(text)
            (folder / name).chmod(0o755)
    (folder / "gpus.csv").write_text("".join(f"{row}\n" for row in (gpus if gpus is not None else [GPU0])))
    return FakeTools(folder)
