import subprocess
import sys

from server.cli import main


def test_version_flag_prints_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.startswith("pdserve ")


def test_console_help_runs():
    out = subprocess.run([sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "disaggregated" in out.stdout
