import subprocess
import sys

from server.cli import build_parser, main


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


def test_ray_flags_belong_to_ray(capsys, tmp_path):
    assert main(["launch", str(tmp_path / "d.yaml"), "--detach"]) == 2
    assert "--detach and --name go with --ray" in capsys.readouterr().err
    args = build_parser().parse_args(["ray", "down", "pair", "--address", "10.0.0.1:6379"])
    assert (args.command, args.action, args.name, args.address, args.namespace) == (
        "ray", "down", "pair", "10.0.0.1:6379", "pdserve")
