"""The gsched console script, driven as a user would (in-process for speed)."""

from __future__ import annotations

import json
import subprocess
import sys

from lightning_gsched.cli import main
from lightning_gsched.schedule.library import LIBRARY


def test_plan_json_has_the_documented_fields(capsys):
    assert main(["plan", "fslpp", "--workers", "4", "--stages", "4", "--microbatches", "8", "--R", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ["schedule", "workers", "stages", "microbatches", "latency", "bubble_fraction", "per_worker", "timeline"]:
        assert key in data
    assert (data["schedule"], data["workers"], data["stages"], data["microbatches"]) == ("fslpp", 4, 4, 8)
    assert len(data["timeline"]) == 2 * 4 * 8
    assert {"worker", "stage", "micro", "phase", "start", "end"} <= set(data["timeline"][0])
    fields = {"worker", "busy", "activation_recvs", "weight_fetches", "grad_sends", "peak_activations",
              "owned_stages", "peak_resident_stages"}
    assert all(fields <= set(w) for w in data["per_worker"]) and len(data["per_worker"]) == 4
    assert data["latency"] == max(t["end"] for t in data["timeline"])


def test_plan_text_png_and_programs(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "1f1b", "-w", "4", "-b", "8", "--forward-cost", "1", "--backward-cost", "1,1,2,2",
                 "--png", str(png), "--programs"]) == 0
    out = capsys.readouterr().out
    assert "schedule 1f1b: W=4 S=4 B=8" in out and "rank 3:" in out and "SEND_ACT s0 b0 ->1" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_lists_every_library_schedule(capsys):
    assert main(["compare", "-w", "4", "-s", "4", "-b", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in rows] == list(LIBRARY)  # every entry, in the library's order
    by = {r["schedule"]: r for r in rows}
    assert by["ddp"]["weight_fetches_per_worker"] == 0 and by["ddp"]["activation_msgs_per_worker"] == 0
    assert by["1f1b"]["latency"] == by["gpipe"]["latency"]
    assert by["1f1b"]["activation_storage_per_worker"] < by["gpipe"]["activation_storage_per_worker"]


def test_compare_reports_invalid_sizes_per_schedule(capsys):
    assert main(["compare", "-w", "4", "-s", "2", "-b", "8"]) == 0
    out = capsys.readouterr().out
    assert "not valid for these sizes" in out and "gpipe: stages S=2" in out


def test_errors_exit_2_with_message(capsys):
    assert main(["plan", "lpp", "-w", "6", "--R", "4"]) == 2
    assert "R=4 does not divide" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "lightning_gsched.cli", "plan", "gpipe", "-w", "2", "-b", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert "latency 9" in out  # (B + S - 1)(f + b) = 3 * 3


def test_reader_leaving_early_is_not_an_error():
    """``gsched plan ... | head -1``: the closed pipe ends the command quietly, exit 0."""
    command = [sys.executable, "-m", "lightning_gsched.cli", "plan", "fslpp", "-w", "8", "-b", "64",
               "--programs"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # as head does after its first line
        stderr = proc.stderr.read()
        code = proc.wait(timeout=60)
    assert first.startswith(b"schedule fslpp")
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr, stderr.decode()
    assert code == 0
