"""``gsched tune`` end to end on a small model: profile per stage count, rank, pick, errors."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from lightning_gsched import cli
from lightning_gsched.measure.tune_profile import tune_model
from models import gpt_inputs, make_gpt

TARGET = "tests/test_tune_cli.py:tiny_target"


def tiny_target() -> tuple:
    """The target `gsched tune` loads: a 4-layer GPT and one microbatch of 2 rows."""
    model = make_gpt(layers=4)
    (idx,) = gpt_inputs(batch=2)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.reshape(-1))

    return model, (idx,), loss_fn


ROW = re.compile(r"^\s+\d+\s+(\S+ S=.*?)\s+(\d+)\s+(-|replicate|shard)\s+([\d.]+) ms\s+"
                 r"([\d.]+ \S+)\s+(yes|no)", re.M)


def _rows(text: str) -> list[tuple[str, int, str, float, str, str]]:
    """The table's rows: (candidate, G, mode, step ms, peak, fits)."""
    return [(c.strip(), int(G), mode, float(ms), peak, fits)
            for c, G, mode, ms, peak, fits in ROW.findall(text)]


def test_tune_ranks_and_picks_within_the_budget(capsys) -> None:
    assert cli.main(["tune", TARGET, "-w", "2", "--global-batch", "8",
                     "--schedules", "gpipe", "1f1b", "zbv", "fsdp"]) == 0
    free = capsys.readouterr().out
    assert "budget none" in free and "pick: " in free
    rows = _rows(free)
    assert rows and all(fits == "yes" for *_, fits in rows)
    times = [t for _, _, _, t, _, _ in rows]
    assert times == sorted(times)
    assert {(G, mode) for _, G, mode, *_ in rows} == {(1, "-")}  # W=2: G=2 is ddp/fsdp
    # a budget between the smallest and the largest peak: the pick is under it
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    peaks = sorted(float(p.split()[0]) * units[p.split()[1]] for *_, p, _ in rows)
    budget = int((peaks[0] + peaks[-1]) / 2)
    assert cli.main(["tune", TARGET, "-w", "2", "--global-batch", "8", "--budget", str(budget),
                     "--schedules", "gpipe", "1f1b", "zbv", "fsdp"]) == 0
    ranked = capsys.readouterr().out
    pick = ranked.split("pick: ")[1].strip()
    chosen = [r for r in _rows(ranked) if r[0] == pick]
    assert chosen and chosen[0][5] == "yes"
    value, unit = chosen[0][4].split()
    assert float(value) * units[unit] <= budget * 1.001  # printed with one decimal
    assert "no: peak" in ranked


def test_impossible_budget_is_an_error_naming_the_smallest_peak(capsys) -> None:
    assert cli.main(["tune", TARGET, "-w", "2", "--global-batch", "8", "--budget", "1KiB",
                     "--schedules", "1f1b"]) == 2
    err = capsys.readouterr().err
    assert "no candidate fits the memory budget of 1.0 KiB" in err
    assert "smallest predicted peak is" in err


def test_bad_target_and_budget_are_clear_errors(capsys) -> None:
    assert cli.main(["tune", "nofile.py:f", "-w", "2", "--global-batch", "8"]) == 2
    assert "no file nofile.py" in capsys.readouterr().err
    assert cli.main(["tune", "tests/test_tune_cli.py:nothing", "-w", "2",
                     "--global-batch", "8"]) == 2
    assert "has no function nothing" in capsys.readouterr().err
    for budget in ("lots", "infGB", "1e400GB"):  # float() reads "inf" and overflows to it
        try:
            cli.main(["tune", TARGET, "-w", "2", "--global-batch", "8", "--budget", budget])
        except SystemExit as exc:  # argparse: usage, exit 2, the rule
            assert exc.code == 2
        assert f"memory_budget={budget!r} is not valid" in capsys.readouterr().err


def test_tuning_leaves_the_model_as_it_was() -> None:
    model, args, loss_fn = tiny_target()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    result = tune_model(model, args, 2, 8, loss_fn=loss_fn, schedules=["1f1b"],
                        checkpoint=(False,), repeats=1)
    assert result.best is not None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_fixed_stages_microbatches_and_R_restrict_the_search(capsys) -> None:
    assert cli.main(["tune", TARGET, "-w", "2", "--global-batch", "8", "-s", "4", "-b", "4",
                     "--R", "2", "--no-checkpointing"]) == 0
    rows = re.findall(r"^\s+\d+\s+(\S+) S=(\d+) B=(\d+)( R=\d+)?", capsys.readouterr().out,
                      re.M)
    assert rows
    assert all(S == "4" and B == "4" and R == " R=2" for _, S, B, R in rows)
    assert {name for name, *_ in rows} <= {"lpp", "interleaved", "fslpp", "fslpp-seed"}


def test_runtime_cost_flags_reach_the_tuner(capsys, monkeypatch) -> None:
    """The flags replace DEFAULT_COSTS' fields (one --message-cpu for both ends); no flag keeps
    the defaults; a negative value is the cost model's error, exit 2."""
    from lightning_gsched.measure import tune_profile
    from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts

    seen: list[RuntimeCosts] = []
    real = tune_profile.tune_model

    def spy(*args, **kwargs):
        seen.append(kwargs["costs"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tune_profile, "tune_model", spy)
    base = ["tune", TARGET, "-w", "2", "--global-batch", "8", "--schedules", "gpipe",
            "--no-checkpointing", "-b", "4", "-s", "2"]
    assert cli.main(base) == 0
    assert cli.main(base + ["--job-overhead", "0.01", "--message-cpu", "0.002", "--latency",
                            "0", "--bandwidth", "5e8"]) == 0
    capsys.readouterr()
    assert seen[0] == DEFAULT_COSTS
    assert seen[1] == RuntimeCosts(**{**DEFAULT_COSTS.__dict__, "job_cpu": 0.01,
                                      "send_cpu": 0.002, "recv_cpu": 0.002, "latency": 0.0,
                                      "bandwidth": 5e8})
    assert cli.main(base + ["--message-cpu", "-1"]) == 2
    assert "send_cpu must be a non-negative number" in capsys.readouterr().err


def test_data_parallel_size_fixes_G_and_both_modes_are_ranked(capsys) -> None:
    """``--dp 2`` on 4 workers: every row is 2 replicas of a 2-worker schedule, in both modes,
    and the pick names its G and mode; a G that does not divide W is the planner's error."""
    base = ["tune", TARGET, "-w", "4", "--global-batch", "16", "--schedules", "1f1b", "zbv",
            "--no-checkpointing", "--top", "40"]
    assert cli.main(base + ["--dp", "2"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows and {G for _, G, *_ in rows} == {2}
    assert {mode for _, _, mode, *_ in rows} == {"replicate", "shard"}
    pick = out.split("pick: ")[1].strip()
    best = rows[0]
    assert pick == f"{best[0]} G=2 {best[2]}"
    assert cli.main(base + ["--data-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "data_parallel_size=3 does not divide the W=4 workers" in err and "[1, 2, 4]" in err
    # ddp and fsdp are data parallel over all ranks already: named with --dp 2, every row of
    # theirs was dropped silently ("nothing fits", found by probing); now plan()'s error
    assert cli.main(base[:6] + ["--schedules", "ddp", "--dp", "2"]) == 2
    assert "'ddp' is data parallel over all W ranks already" in capsys.readouterr().err


def test_no_candidate_that_can_be_planned_exits_1_saying_why(capsys) -> None:
    """1f1b at S=3 on 2 workers plans nowhere: the pick says so (it said "nothing fits",
    without a budget) and the exit code tells a script there is no pick."""
    assert cli.main(["tune", TARGET, "-w", "2", "--global-batch", "8", "--schedules", "1f1b",
                     "-s", "3"]) == 1
    out = capsys.readouterr().out
    assert "dropped before costing" in out and "S=3" in out
    assert "pick: none: no candidate could be planned" in out
