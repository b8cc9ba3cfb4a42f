"""``gsched plan|compare|tune --tp T`` and the bytes a tensor-parallel rank holds (issue 35).

With T ranks per worker, ``-w`` counts ranks and the schedule runs on W / T workers: every
per-worker figure must be the W / T-worker plan's, the text must say the layout, T = 1 must
print what it always printed, and ``--stage-bytes`` (the unsharded model's) become one rank's
share.
"""

from __future__ import annotations

import json

import pytest

from lightning_gsched.cli import main
from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.describe import describe, plan_command
from lightning_gsched.schedule.memory import resident_bytes, tensor_parallel_share
from lightning_gsched.schedule.render import ascii_timeline


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0, argv
    return json.loads(capsys.readouterr().out)


def _text(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0, argv
    return capsys.readouterr().out


# ------------------------------------------------------------------ the plan of W / T workers


@pytest.mark.parametrize("option", ["--tp", "--tensor-parallel-size"])
def test_tp_2_at_4_ranks_plans_2_workers(option, capsys):
    """-w 4 --tp 2: two workers of two ranks, each worker's figures those of 1f1b on 2."""
    data = _json(capsys, ["plan", "1f1b", "-w", "4", option, "2", "-b", "4", "--json"])
    alone = plan("1f1b", workers=2, microbatches=4)
    assert (data["workers"], data["tensor_parallel_size"], data["pipeline_size"]) == (2, 2, 2)
    assert len(data["per_worker"]) == len(data["programs"]) == 2
    assert data["latency"] == alone.metrics.latency and data["stages"] == alone.stages
    assert data["per_worker"] == [m.as_dict() for m in alone.metrics.per_worker]
    assert data["programs"] == [[str(a) for a in p] for p in alone.programs.ranks]


def test_plan_text_states_the_ranks_as_P_x_G_x_T(capsys):
    head = _text(capsys, ["plan", "1f1b", "-w", "4", "--tp", "2", "-b", "4"]).splitlines()[0]
    assert head.startswith("schedule 1f1b: W=4 (P=2 x T=2; worker w = ranks 2w..2w+1) S=2 B=4")
    out = _text(capsys, ["plan", "1f1b", "-w", "16", "--dp", "2", "--tp", "4", "-b", "4"])
    assert out.startswith("schedule 1f1b: W=16 (P=2 x G=2 x T=4, replicate; worker w = ranks "
                          "4w..4w+3) S=2 B=8 (4 per replica)")
    rows = [line.split()[0] for line in out.split("\n\n")[0].splitlines()[4:]]
    assert rows == ["0", "1", "2", "3"]  # the table has the W / T = 4 workers' rows


def test_tp_with_dp_matches_the_plan_of_the_workers(capsys):
    """-w 16 --dp 2 --tp 2 is the plan of 8 workers as 2 replicas, per worker."""
    data = _json(capsys, ["plan", "zbv", "-w", "16", "--dp", "2", "--tp", "2", "--json"])
    alone = plan("zbv", workers=8, data_parallel_size=2)
    assert (data["workers"], data["pipeline_size"], data["data_parallel_size"]) == (8, 4, 2)
    assert data["caps"] == alone.caps and data["latency"] == alone.metrics.latency
    assert data["per_worker"] == [m.as_dict() for m in alone.metrics.per_worker]


@pytest.mark.parametrize("command", [["plan", "1f1b"], ["compare"]])
def test_a_tp_not_dividing_w_exits_2_naming_the_divisors(command, capsys):
    assert main([*command, "-w", "6", "--tp", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "gsched: error: tensor_parallel_size=4 does not divide the W=6 ranks" in captured.err
    assert "Choose tensor_parallel_size among [1, 2, 3, 6]" in captured.err


def test_a_dp_not_dividing_the_workers_says_so_with_tp(capsys):
    assert main(["plan", "1f1b", "-w", "8", "--tp", "2", "--dp", "3"]) == 2
    err = capsys.readouterr().err
    assert "W / tensor_parallel_size = 4 workers of 2 ranks each" in err
    assert "data_parallel_size=3 does not divide the W=4 workers" in err


@pytest.mark.parametrize("value", ["0", "two", "1.5"])
def test_bad_tp_values_are_argparse_errors(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "1f1b", "-w", "4", "--tp", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gsched")
    assert "argument --tp/--tensor-parallel-size: tensor_parallel_size=" in err


def test_plan_command_round_trips_a_tensor_parallel_plan(capsys):
    """The start-up summary's command (-w in ranks, --tp T) prints the same plan."""
    for kwargs in ({}, {"data_parallel_size": 2}, {"cap": [3, 2, 2, 1]}):
        result = plan("1f1b", workers=8, tensor_parallel_size=2, microbatches=4, **kwargs)
        words = plan_command(result).split()
        assert words[words.index("-w") + 1] == "8" and words[words.index("--tp") + 1] == "2"
        data = _json(capsys, [*words[1:], "--json"])
        assert (data["workers"], data["tensor_parallel_size"]) == (result.workers, 2)
        assert data["caps"] == result.caps and data["microbatches"] == result.micro
        assert data["latency"] == result.metrics.latency and data["stages"] == result.stages


def test_plan_command_leaves_out_tp_1():
    assert "--tp" not in plan_command(plan("1f1b", workers=4))


# ------------------------------------------------------------------ T = 1 prints as before


@pytest.mark.parametrize("argv,kwargs", [
    (["1f1b", "-w", "4", "-b", "8"], {"schedule": "1f1b", "workers": 4, "microbatches": 8}),
    (["fslpp", "-w", "4", "-s", "4", "--R", "2"],
     {"schedule": "fslpp", "workers": 4, "stages": 4, "R": 2}),
    (["zbv", "-w", "2", "-b", "4"], {"schedule": "zbv", "workers": 2, "microbatches": 4}),
    (["gpipe", "-w", "8", "--dp", "2"],
     {"schedule": "gpipe", "workers": 8, "data_parallel_size": 2}),
])
def test_tp_1_prints_what_plan_gives(argv, kwargs, capsys):
    """Without --tp and with --tp 1 the text is plan()'s, the head without a T."""
    result = plan(**kwargs)
    expected = f"{describe(result)}\n\n{ascii_timeline(result.timeline)}\n"
    assert _text(capsys, ["plan", *argv]) == expected
    assert _text(capsys, ["plan", *argv, "--tp", "1"]) == expected
    head = expected.splitlines()[0]
    assert "T=" not in head and "worker w = ranks" not in head
    assert head.startswith(f"schedule {result.schedule}: W={result.workers} ")


def test_tp_1_json_and_bytes_are_plans_own(capsys):
    result = plan("fsdp", workers=2, stages=4)
    data = _json(capsys, ["plan", "fsdp", "-w", "2", "-s", "4", "--stage-bytes", "8,8,4,4",
                          "--json"])
    assert "stage_bytes_per_rank" not in data and "stage_bytes" not in data
    held = resident_bytes(result.programs, [8, 8, 4, 4])
    assert [(w["owned_bytes"], w["peak_resident_bytes"]) for w in data["per_worker"]] == [
        (h.owned, h.peak) for h in held]
    del data["per_worker"]
    json_alone = result.to_json()
    del json_alone["per_worker"]
    assert data == json_alone


# ------------------------------------------------------------------ compare


def test_compare_with_tp_compares_the_workers_plans(capsys):
    rows = _json(capsys, ["compare", "-w", "8", "--tp", "2", "-b", "8", "--json"])
    assert rows == _json(capsys, ["compare", "-w", "4", "-b", "8", "--json"])
    assert {r["schedule"]: r for r in rows}["1f1b"]["stages"] == 4
    out = _text(capsys, ["compare", "-w", "8", "--tp", "2", "--dp", "2", "-b", "4"])
    assert out.startswith("W=8 (P=2 x G=2 x T=2, replicate; worker w = ranks 2w..2w+1); B "
                          "counts every replica's microbatches")


# ------------------------------------------------------------------ the bytes of one rank


def test_tensor_parallel_share_divides_the_sharded_part():
    assert tensor_parallel_share([100, 101, 7], 2) == [50, 51, 4]  # the largest shard: ceil
    assert tensor_parallel_share([100, 101, 7], 2, 0) == [100, 101, 7]  # nothing sharded
    assert tensor_parallel_share([1000], 3, 0.9) == [100 + 300]  # 100 replicated, 900 / 3
    assert tensor_parallel_share([100, 100, 10], 4, [1, 0.5, 0.9]) == [25, 50 + 13, 1 + 3]
    assert tensor_parallel_share([64, 64], 1) == [64, 64]


@pytest.mark.parametrize("args,message", [
    (([10], 2, 1.5), "tensor_parallel_sharded=1.5 is not valid"),
    (([10, 10], 2, [0.5]), "tensor_parallel_sharded has 1 values for S=2 stages"),
    (([10], 2, [-0.1]), "tensor_parallel_sharded[0]=-0.1 is not valid"),
    (([10], 2, "all"), "tensor_parallel_sharded='all' is not valid"),
    (([-1], 2), "stage 0's parameter bytes must be a non-negative int"),
    (([10], 0), "tensor_parallel_size=0 is not valid"),
])
def test_tensor_parallel_share_refuses_bad_arguments(args, message):
    with pytest.raises(ScheduleConfigError, match=message.replace("[", r"\[")):
        tensor_parallel_share(*args)


def test_stage_bytes_with_tp_are_one_ranks_share(capsys):
    """--tp 2: owned and peak bytes are those of the 4-worker plan with half of every stage."""
    stage_bytes = [4096, 4096, 3000, 1001]
    argv = ["plan", "fsdp", "-w", "8", "--tp", "2", "-s", "4",
            "--stage-bytes", ",".join(map(str, stage_bytes))]
    data = _json(capsys, [*argv, "--json"])
    halves = [2048, 2048, 1500, 501]
    assert data["stage_bytes"] == stage_bytes and data["stage_bytes_per_rank"] == halves
    held = resident_bytes(plan("fsdp", workers=4, stages=4).programs, halves)
    got = [(w["owned_bytes"], w["peak_resident_bytes"]) for w in data["per_worker"]]
    assert got == [(h.owned, h.peak) for h in held]
    assert got != [(h.owned, h.peak) for h in resident_bytes(
        plan("fsdp", workers=4, stages=4).programs, stage_bytes)]
    text = _text(capsys, argv)
    assert "bytes are one rank's: each of a worker's T=2 ranks holds 1/2 of every stage's" in text
    table = text.split("\n\n")[0].splitlines()[5:]
    assert [row.split()[-2:] for row in table] == [[str(h.owned), str(h.peak)] for h in held]


def test_tp_sharded_keeps_the_rest_whole(capsys):
    data = _json(capsys, ["plan", "1f1b", "-w", "4", "--tp", "2", "--stage-bytes", "1000,600",
                          "--tp-sharded", "0.5,1", "--json"])
    assert data["stage_bytes_per_rank"] == [500 + 250, 300]
    assert [w["owned_bytes"] for w in data["per_worker"]] == [750, 300]
    text = _text(capsys, ["plan", "1f1b", "-w", "4", "--tp", "2", "--stage-bytes", "1000,600",
                          "--tp-sharded", "0.9"])
    assert "holds the sharded part (--tp-sharded 0.9) of every stage's --stage-bytes / 2" in text


@pytest.mark.parametrize("argv,message", [
    (["-w", "4", "--stage-bytes", "1,2,3,4", "--tp-sharded", "0.5"], "needs --tp T > 1 and"),
    (["-w", "4", "--tp", "2", "--tp-sharded", "0.5"], "needs --tp T > 1 and --stage-bytes"),
    (["-w", "4", "--tp", "2", "--stage-bytes", "1,2", "--tp-sharded", "1,1,1"],
     "tensor_parallel_sharded has 3 values for S=2 stages"),
    (["-w", "4", "--tp", "2", "--stage-bytes", "1,2,3"],
     "--stage-bytes has 3 values but the plan has S=2 stages"),
])
def test_tp_sharded_errors_exit_2_naming_the_fix(argv, message, capsys):
    assert main(["plan", "1f1b", *argv]) == 2
    assert message in capsys.readouterr().err


def test_tp_sharded_out_of_range_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "1f1b", "-w", "4", "--tp", "2", "--tp-sharded", "2"])
    assert exit_.value.code == 2
    assert "argument --tp-sharded/--tensor-parallel-sharded: tensor_parallel_sharded=2.0 is " \
           "not valid" in capsys.readouterr().err


# ------------------------------------------------------------------ tune


def test_tune_checks_t_and_its_plan_before_loading_the_target(capsys):
    """Refused first (the target does not exist, and the error is still the T one)."""
    assert main(["tune", "missing.py:target", "-w", "4", "--global-batch", "8", "--tp", "2"]) == 2
    assert "tensor_parallel_size=2 needs a tensor_parallel_plan" in capsys.readouterr().err
    assert main(["tune", "missing.py:target", "-w", "6", "--global-batch", "8", "--tp", "4",
                 "--tp-plan", DEMO_PLAN]) == 2
    assert "Choose tensor_parallel_size among [1, 2, 3, 6]" in capsys.readouterr().err
    assert main(["tune", "missing.py:target", "-w", "4", "--global-batch", "8", "--tp", "2",
                 "--tp-plan", "{not json"]) == 2
    assert "--tp-plan is not valid JSON" in capsys.readouterr().err


# the demo GPT's plan, as configs/1f1b_3d.yaml writes it
DEMO_PLAN = json.dumps({"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
                        "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise",
                        "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"})
# the same with sequence parallelism, as configs/1f1b_sp.yaml writes it
SEQUENCE_PLAN = json.dumps({
    "blocks.0": "sequence_input", "blocks.*.ln1": "sequence", "blocks.*.ln2": "sequence",
    "blocks.*.attn": "sequence_gather",
    **{f"blocks.*.attn.{m}": "colwise" for m in "qkv"}, "blocks.*.mlp.0": "colwise_from_sequence",
    **{f"blocks.*.{m}": "rowwise_to_sequence" for m in ("attn.proj", "mlp.2")},
    "blocks.3": "sequence_output"})
FIXED = ["--global-batch", "16", "--schedules", "1f1b", "-s", "2", "-b", "4",
         "--no-checkpointing", "--top", "3"]


def _first_row_peak(table: str) -> float:
    """The peak per rank (MiB) of the table's first row (1f1b S=2 B=4)."""
    row = next(line for line in table.splitlines() if line.startswith("   1  1f1b S=2 B=4 "))
    value, unit = row.split()[-3:-1]
    return float(value) * {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit]


def test_tune_profiles_stages_sharded_over_t_processes_and_searches_t(capsys):
    """The same pipeline of 2 workers, each one rank (-w 2) or T=2 ranks (-w 4 --tp 2, its
    stages profiled sharded by the demo's plan in 2 processes): a rank holds about half the
    sharded layers' bytes; with --tp 1 2 both are tuned and the faster named. With sequence
    parallelism by name the stages are profiled sharded too, without --leaf-modules: the
    blocks its styles name (and the holders of its norms) are kept whole for their hooks."""
    assert main(["tune", "examples/gpt.py:tune_target", "-w", "2", *FIXED]) == 0
    whole = _first_row_peak(capsys.readouterr().out)
    assert main(["tune", "examples/gpt.py:tune_target", "-w", "4", "--tp", "1", "2",
                 "--tp-plan", DEMO_PLAN, *FIXED]) == 0
    out = capsys.readouterr().out
    sharded_table = out[out.index("W=4 (2 workers of T=2 ranks)"):]
    sharded = _first_row_peak(sharded_table)
    assert sharded < 0.8 * whole, (sharded, whole)
    assert "over every --tp value: fastest fitting is T=" in out
    # sequence parallelism by name: its first and last blocks' styles need the blocks whole,
    # which the split keeps so by itself (kept_whole)
    assert main(["tune", "examples/gpt.py:tune_target", "-w", "4", "--tp", "2",
                 "--tp-plan", SEQUENCE_PLAN, *FIXED]) == 0
    sequence = _first_row_peak(capsys.readouterr().out)
    assert sequence < 0.8 * whole, (sequence, whole)
