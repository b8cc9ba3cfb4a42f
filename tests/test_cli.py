"""The gsched console script, driven as a user would (in-process for speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


# ------------------------------------------------------------------ pipelines x data parallel


def test_plan_data_parallel_header_json_and_command(capsys):
    """``--dp 2`` plans 2 replicas of the 4-worker 1f1b: the header says P x G and the mode,
    ``-b`` is one replica's, and each worker stashes what its position stashes in 1f1b on 4
    workers (the P-worker schedule's cap, lifted)."""
    assert main(["plan", "1f1b", "-w", "8", "--dp", "2", "-b", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["data_parallel_size"], data["data_parallel"], data["pipeline_size"]) == (2, "replicate", 4)
    assert data["microbatches"] == 16 and data["complete"] is True
    assert main(["plan", "1f1b", "-w", "4", "-b", "8", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    stash = [w["peak_activations"] for w in data["per_worker"]]
    assert stash == [alone["per_worker"][rank // 2]["peak_activations"] for rank in range(8)]
    assert main(["plan", "1f1b", "-w", "8", "--dp", "2", "--data-parallel", "shard"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("schedule 1f1b: W=8 (P=4 x G=2, shard) S=8 B=16 (8 per replica)")


def test_plan_data_parallel_long_option_and_png(tmp_path, capsys):
    png = tmp_path / "dp.png"
    assert main(["plan", "gpipe", "-w", "4", "--data-parallel-size", "2", "--png", str(png)]) == 0
    assert "W=4 (P=2 x G=2, replicate)" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_command_round_trips_a_data_parallel_plan(capsys):
    """The start-up summary's command prints the same plan: ``-b`` per replica, ``--dp``,
    the mode, and a cap given per pipeline position."""
    from lightning_gsched.schedule import plan
    from lightning_gsched.schedule.describe import plan_command

    for kwargs in ({}, {"data_parallel": "shard"}, {"cap": [3, 2, 2, 1]}):
        result = plan("1f1b", workers=8, data_parallel_size=2, **kwargs)
        argv = plan_command(result).split()[1:] + ["--json"]
        assert main(argv) == 0, argv
        data = json.loads(capsys.readouterr().out)
        assert data["caps"] == result.caps and data["microbatches"] == result.micro
        assert data["data_parallel"] == result.data_parallel and data["stages"] == result.stages


def test_plan_command_and_summary_name_a_split_backward_override(capsys):
    """split_backward= given against the schedule's default: the summary's first line says so
    and its command (``--split-backward`` / ``--no-split-backward``) prints the plan that runs
    (it printed the default's, another latency; found by probing)."""
    from lightning_gsched.schedule import plan
    from lightning_gsched.schedule.describe import configuration_text, plan_command

    for name, split, word in (("zbv", False, "off"), ("1f1b", True, "on")):
        result = plan(name, workers=3, split_backward=split)
        assert f"split-backward={word}" in configuration_text(result)
        argv = plan_command(result).split()[1:] + ["--json"]
        assert main(argv) == 0, argv
        assert json.loads(capsys.readouterr().out)["latency"] == result.metrics.latency
        default = plan(name, workers=3)
        assert "split-backward" not in configuration_text(default)
        assert default.metrics.latency != result.metrics.latency


def test_data_parallel_errors_exit_2_naming_the_fix(capsys):
    assert main(["plan", "1f1b", "-w", "8", "--dp", "3"]) == 2
    err = capsys.readouterr().err
    assert "data_parallel_size=3 does not divide the W=8 workers" in err and "[1, 2, 4, 8]" in err
    assert main(["plan", "ddp", "-w", "8", "--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert "'ddp' is data parallel over all W ranks already" in err and "1f1b" in err
    assert main(["plan", "1f1b", "-w", "8", "--data-parallel", "shard"]) == 2
    assert "data_parallel_size to 2 or more" in capsys.readouterr().err
    # sharding over replicas raises S (here 2 -> 4): bytes per stage of the asked S were an
    # IndexError's traceback (found by probing)
    assert main(["plan", "1f1b", "-w", "4", "--dp", "2", "--data-parallel", "shard",
                 "--stage-bytes", "1,2"]) == 2
    assert "--stage-bytes has 2 values but the plan has S=4 stages" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--dp", "0"], "argument --dp/--data-parallel-size: data_parallel_size=0 is not valid"),
    (["--dp", "two"], "argument --dp/--data-parallel-size: data_parallel_size='two' is not valid"),
    (["--data-parallel", "mirror"], "argument --data-parallel: invalid choice: 'mirror'"),
])
@pytest.mark.parametrize("command", [["plan", "1f1b"], ["compare"]])
def test_data_parallel_bad_values_are_argparse_errors(command, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "-w", "8", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gsched") and message in err


def test_compare_with_data_parallel_skips_ddp_and_fsdp(capsys):
    assert main(["compare", "-w", "8", "--dp", "2", "--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(LIBRARY)
    assert "data parallel" in rows["ddp"]["skipped"] and "skipped" in rows["fsdp"]
    assert rows["1f1b"]["microbatches"] == 16 and rows["1f1b"]["activation_storage_per_worker"] == 4
    assert main(["compare", "-w", "8", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("W=8 (P=4 x G=2, replicate)")
    assert "not run with --dp > 1: ddp, fsdp" in out and "\nddp " not in out


def test_plan_checkpoint_stages_are_checked_against_a_replicas_S(capsys):
    """``--checkpoint-stages`` names stages of the plan's S: a replica's default S with --dp
    (1f1b on P=2 workers: S=2), not W's (S=4)."""
    assert main(["plan", "1f1b", "-w", "4", "--dp", "2", "--checkpoint-stages", "2"]) == 2
    assert "the plan has S=2 stages" in capsys.readouterr().err
    assert main(["plan", "1f1b", "-w", "4", "--dp", "2", "--checkpoint-stages", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpointed"] == [False, True]


# ------------------------------------------------------------------ --json at large W


def _planned(monkeypatch) -> list:
    """The plans ``gsched plan`` builds, to count what their programs lowered."""
    import lightning_gsched.cli as cli

    plans: list = []

    def keep(*args, **kwargs):
        plans.append(cli.plan_arguments.__wrapped__(*args, **kwargs))
        return plans[-1]

    keep.__wrapped__ = cli.plan_arguments  # type: ignore[attr-defined]
    monkeypatch.setattr(cli, "plan_arguments", keep)
    return plans


def test_plan_json_beyond_max_rows_lists_the_table_rows_without_every_program(monkeypatch, capsys):
    """W=1024 (fsdp: lowered per rank): ``--json`` answers with the head, the owners and the
    shown workers' rows, and lowers only those workers' programs (every rank's is a minute at
    W=1024)."""
    from lightning_gsched.schedule.describe import SHOWN_FIRST, SHOWN_LAST

    plans = _planned(monkeypatch)
    W = 1024
    assert main(["plan", "fsdp", "-w", str(W), "--json", "--stage-bytes", ",".join(["8"] * W)]) == 0
    data = json.loads(capsys.readouterr().out)
    shown = [*range(SHOWN_FIRST), *range(W - SHOWN_LAST, W)]
    assert data["complete"] is False and "timeline" not in data and "programs" not in data
    assert [w["worker"] for w in data["per_worker"]] == shown
    assert f"workers {SHOWN_FIRST}-{W - SHOWN_LAST - 1}" in data["omitted"]
    assert "--programs" in data["omitted"]
    assert len(data["owners"]) == data["stages"] == W and data["latency"] > 0
    # every stage 8 bytes: owned one stage, peak resident 8 bytes per resident stage
    assert all(w["owned_bytes"] == 8 and w["peak_resident_bytes"] == 8 * w["peak_resident_stages"]
               for w in data["per_worker"])
    result = plans[-1]
    assert result.programs.ranks.lowered == result.metrics.per_worker.lowered == len(shown)
    # (that each sampled row equals the fully lowered plan's: test_schedule_scale.py)


def test_plan_json_data_parallel_at_W_1024(monkeypatch, capsys):
    """P=16 x G=64 at W=1024: the JSON says the shape and lists the table's rows."""
    plans = _planned(monkeypatch)
    assert main(["plan", "1f1b", "-w", "1024", "--dp", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["pipeline_size"], data["data_parallel_size"], data["stages"]) == (16, 64, 16)
    assert data["complete"] is False and len(data["per_worker"]) == 6
    # ranks 0-3 are position 0 of replicas 0-3; 1022, 1023 position 15: the stash of 1f1b on 16
    assert [w["peak_activations"] for w in data["per_worker"]] == [16] * 4 + [1] * 2
    assert plans[-1].stages == 16


def test_plan_json_with_programs_lists_everything_at_any_W(capsys):
    W = 64  # beyond MAX_ROWS
    assert main(["plan", "gpipe", "-w", str(W), "-b", "1", "--json", "--programs"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["complete"] is True and "omitted" not in data
    assert len(data["per_worker"]) == len(data["programs"]) == W
    assert len(data["timeline"]) == 2 * W


def test_compare_refuses_a_data_parallel_size_that_does_not_divide_once(capsys):
    """It printed an empty table headed "P=1 x G=3" and the same error per schedule, exit 0."""
    assert main(["compare", "-w", "4", "--dp", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("data_parallel_size=3 does not divide the W=4 workers") == 1


def test_a_shared_placement_refusal_names_the_schedule_asked_for(capsys):
    """1f1b runs on gpipe's placement, which named itself: "gpipe: stages S=3 ..."."""
    assert main(["plan", "1f1b", "-w", "4", "-s", "3"]) == 2
    assert "1f1b (on gpipe's placement): stages S=3" in capsys.readouterr().err


def test_a_plan_too_large_is_refused_before_anything_of_its_size_is_built():
    """At W = 10**8 the 1f1b cap list (one int per worker) exhausted the memory before the
    job-count limit refused the plan; the limit now comes first. The allocator's peak during
    the refusal, measured by tracemalloc, is far below one list of W entries (80 MB here)."""
    import tracemalloc

    from lightning_gsched.errors import ScheduleConfigError
    from lightning_gsched.schedule import plan

    tracemalloc.start()
    try:
        with pytest.raises(ScheduleConfigError, match="more than the"):
            plan("1f1b", workers=10**7)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 10**6, peak


def test_consolidate_refuses_a_folder_that_is_not_a_sharded_checkpoint(tmp_path, capsys):
    """(A directory written by the strategy is consolidated in tests/test_fabric.py.)"""
    assert main(["consolidate", str(tmp_path), str(tmp_path / "out.ckpt")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a sharded checkpoint directory" in err
    assert "state_dict_type='sharded' wrote" in err
    assert not (tmp_path / "out.ckpt").exists()
