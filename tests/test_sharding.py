"""Sharded EVON (``prepare_distributed(..., shard=True)``) on 1, 2 and 3 CPU processes (gloo).

``tests/sharded_worker.py`` trains the same tiny float64 model on each world size (the
global batch split over the ranks) and saves weights, state and posterior; world 1 is the
single-process reference with the same noise semantics (one shared sample, one stream per
matrix). The checks recompute what they compare from shapes and files, not from the
optimizer's own bookkeeping.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import sharded_worker as worker
import torch
from conftest import approx_tree
from launcher import runs_per_world, scenario_results
from torch import nn

from hf_evon import EVONPosterior, build_optimizer, prepare_distributed
from hf_evon.distributed.sharding import assign_owners, optimizer_state_bytes
from hf_evon.optim.linalg import rotated_std

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "sharded_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, trainer_launches) -> dict[int, tuple[str, list[dict]]]:
    """``{world: (its output directory, what each rank saved)}``: world 2 in the 2-rank launch of
    ``trainer_launches``."""
    out = runs_per_world(tmp_path_factory, WORKER, "world", worlds=(1, 3))
    out[2] = trainer_launches[2][0], trainer_launches[2][1]("sharded")
    return out


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-300)) for k in a)


@pytest.mark.parametrize("world", [2, 3])
def test_every_step_equals_the_single_process_run(runs, world: int) -> None:
    ref = runs[1][1][0]
    ranks = runs[world][1]
    for r in ranks:
        assert len(r["trace"]) == worker.STEPS
        assert len(r["samples"]) == worker.RESUME_AT * worker.HP["mc_samples"]
        for a, b in zip(ref["samples"], r["samples"]):  # each posterior sample, as every rank saw it
            assert _max_rel(a, b) <= 1e-6
        for a, b in zip(ref["trace"], r["trace"]):
            assert _max_rel(a, b) <= 1e-6
    # and the noise really moved the weights: the comparison is not of untouched values
    assert _max_rel(ref["samples"][-1], ref["trace"][worker.RESUME_AT - 2]) > 1e-4


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_hold_bitwise_identical_weights(runs, world: int) -> None:
    ranks = runs[world][1]
    for r in ranks[1:]:
        for a, b in zip(ranks[0]["trace"], r["trace"]):
            assert all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(ranks[0]["samples"], r["samples"]):
            assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_from_a_full_state_dict_is_bit_for_bit(runs, world: int) -> None:
    for r in runs[world][1]:
        final = r["trace"][-1]
        assert all(torch.equal(final[k], r["resumed"][k]) for k in final)
        a, b = r["full_state"]["state"], r["resumed_state"]["state"]
        assert a.keys() == b.keys()
        for i in a:
            assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_state_dict_is_the_unsharded_one(runs, world: int) -> None:
    ref = runs[1][1][0]["full_state"]
    for r in runs[world][1]:
        sd = r["full_state"]
        assert sd["param_groups"] == approx_tree(ref["param_groups"])
        assert sd["evon"] == ref["evon"]
        assert sd["state"].keys() == ref["state"].keys()
        for i, st in ref["state"].items():
            assert st.keys() == sd["state"][i].keys()
            for k, v in st.items():
                torch.testing.assert_close(sd["state"][i][k], v, rtol=1e-6, atol=1e-12)


def _expected_state_bytes(owned: list[bool]) -> int:
    """Bytes of state for the owned parameters of the worker's model, from shapes alone:
    an EVON 8x8 float64 weight (layers 0-12) holds hess, exp_avg, L, R, Q_L, Q_R and two numbers
    (exp_avg_sq_norm, the SNR step scale's EMA of ‖G‖²; noise_watched, the health check's watch); an AdamW
    tensor (layer 14's weight, every bias) exp_avg, exp_avg_sq and a float32 step; each EVON
    weight its float32 update count."""
    model = worker.tiny_model()
    name_of = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, adamw_patterns=[r"^14\."], **worker.HP)
    order = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]
    total = 0
    for name, mine in zip(order, owned):
        if not mine:
            continue
        numel = 64 if name.endswith("weight") else 8
        if name.endswith("weight") and not name.startswith("14."):
            total += 6 * numel * 8 + 2 * 8 + 4
        else:
            total += 2 * numel * 8 + 4
    return total


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_holds_only_its_share_of_the_state(runs, world: int) -> None:
    ranks = runs[world][1]
    total = runs[1][1][0]["state_bytes"]
    assert total == _expected_state_bytes([True] * 16)
    owners = [[r["owned"][i] for r in ranks] for i in range(16)]
    assert all(sum(o) == 1 for o in owners)  # every parameter has exactly one owner
    for r in ranks:
        assert r["state_bytes"] == _expected_state_bytes(r["owned"])
        assert r["state_bytes"] <= 1.2 * total / world


@pytest.mark.parametrize("world", [2, 3])
def test_posterior_of_a_sharded_run_is_the_single_process_one(runs, world: int) -> None:
    ref = EVONPosterior.from_pretrained(os.path.join(runs[1][0], "posterior"))
    post = EVONPosterior.from_pretrained(os.path.join(runs[world][0], "posterior"))  # loads in one process
    assert sorted(os.listdir(os.path.join(runs[world][0], "posterior"))) == sorted(
        os.listdir(os.path.join(runs[1][0], "posterior"))
    )
    drop = {"checkpoint_id"}  # a fresh id per save
    assert {k: v for k, v in post.config.items() if k not in drop} == approx_tree(
        {k: v for k, v in ref.config.items() if k not in drop}
    )
    a, b = ref.to_tensors(), post.to_tensors()
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-12)
    # and it samples the same distribution: same draws from the same seed
    model_a, model_b = worker.tiny_model(), worker.tiny_model()
    with ref.sampled(model_a, seed=3), post.sampled(model_b, seed=3):
        for (n, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
            torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-12, msg=n)


def _null_space_start(stat: torch.Tensor) -> int:
    """The number of nonzero eigenvalues of a Shampoo statistic (its basis lists them first)."""
    ev = torch.linalg.eigvalsh(stat)
    return int((ev > 1e-9 * ev.max()).sum())


@pytest.mark.parametrize("world", [2, 3])
def test_rank_deficient_statistics_give_the_same_posterior_in_another_null_space_basis(runs, world: int) -> None:
    """With rank-deficient L and R (16x16 matrices, 6 rows per step) the eigenvectors of the zero
    eigenvalue are any basis of the null space, and rounding (the ranks' gradient average is summed
    in another order) picks another one, so W ranks' second-step sample differs from one process's
    in that space. Everything else is the same: the first step's statistics, H and means, the
    eigenvectors of the nonzero eigenvalues, the null space itself, the draw in the eigenbasis
    (one noise stream per matrix), each sample's part in the statistics' range, and the posterior's
    covariance (so the sample's distribution). A noise stream that differed with the world size or
    the owner fails the draw's comparison."""
    ref = runs[1][1][0]["rank_deficient"]
    ess, decay = ref["groups"][0]["ess"], ref["groups"][0]["weight_decay"]
    assert ess == 1e4
    close = dict(rtol=1e-6, atol=1e-12)
    for r in runs[world][1]:
        got = r["rank_deficient"]
        for k, v in ref["means"][0].items():
            torch.testing.assert_close(got["means"][0][k], v, **close, msg=k)
        noise = {k: v for rank in runs[world][1] for k, v in rank["rank_deficient"]["noise"][0].items()}
        assert noise.keys() == ref["noise"][0].keys() == {"0.weight", "2.weight"}
        for name in noise:
            a, b = ref["state"][0][name], got["state"][0][name]
            for key in ("L", "R", "hess"):
                torch.testing.assert_close(b[key], a[key], **close, msg=f"{name} {key}")
            torch.testing.assert_close(noise[name], ref["noise"][0][name], **close, msg=name)
            ranges = []
            for side in ("L", "R"):
                rank = _null_space_start(a[side])
                assert rank <= worker.RD_ROWS < worker.RD_DIM  # the case this test is about
                qa, qb = a["Q_" + side], b["Q_" + side]
                torch.testing.assert_close(qb[:, :rank], qa[:, :rank], **close, msg=f"{name} Q_{side}")
                null_a, null_b = qa[:, rank:] @ qa[:, rank:].T, qb[:, rank:] @ qb[:, rank:].T
                torch.testing.assert_close(null_b, null_a, **close, msg=f"{name} Q_{side} null space")
                ranges.append(qa[:, :rank])
            # each run's sample is its mean plus its own draw in its own basis: Q_L E Q_Rᵀ
            for run, e in ((ref, ref["noise"][0][name]), (got, noise[name])):
                st = run["state"][0][name]
                want = run["means"][0][name] + st["Q_L"] @ e @ st["Q_R"].T
                torch.testing.assert_close(run["samples"][1][name], want, rtol=1e-9, atol=1e-12, msg=name)
            # so the samples agree on the statistics' range, and their covariance (Q_L ⊗ Q_R) D (Q_L ⊗ Q_R)ᵀ,
            # D the variances of the draw's entries, is one and the same
            u, v = ranges
            part = [u.T @ (run["samples"][1][name] - run["means"][0][name]) @ v for run in (ref, got)]
            torch.testing.assert_close(part[1], part[0], **close, msg=name)
            cov = []
            for st in (a, b):
                basis = torch.kron(st["Q_L"], st["Q_R"])
                cov.append(basis @ torch.diag(rotated_std(st["hess"], ess, decay).square().flatten()) @ basis.T)
            torch.testing.assert_close(cov[1], cov[0], **close, msg=f"{name} covariance")


@pytest.mark.parametrize("world", [2, 3])
def test_identity_basis_keeps_rank_deficient_runs_equal_at_every_step(runs, world: int) -> None:
    """With ``identity_basis=True`` no eigenbasis is chosen, so the rank-deficient run of
    W ranks equals the one-process run at every sample and step, as the documentation says."""
    ref = runs[1][1][0]["rank_deficient_identity"]
    assert len(ref["samples"]) == len(ref["means"]) == worker.RD_STEPS
    for r in runs[world][1]:
        got = r["rank_deficient_identity"]
        for a, b in zip(ref["samples"] + ref["means"], got["samples"] + got["means"]):
            assert _max_rel(a, b) <= 1e-6
    # and the noise really moved the weights: the comparison is not of untouched values
    assert _max_rel(ref["samples"][-1], ref["means"][-2]) > 1e-4


def test_owners_are_deterministic_and_balanced() -> None:
    costs = [5.0, 5.0, 5.0, 5.0, 1.0, 1.0, 8.0]
    assert assign_owners(costs, 2) == assign_owners(list(costs), 2)
    loads = [0.0, 0.0]
    for c, r in zip(costs, assign_owners(costs, 2)):
        loads[r] += c
    assert sorted(loads) == [15.0, 15.0]
    assert assign_owners(costs, 1) == [0] * len(costs)


def test_single_process_shard_keeps_everything_and_cannot_be_undone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = build_optimizer(model, seed=0)
    handle = prepare_distributed(model, opt, shard=True)
    assert handle is opt and opt.sharding is not None and opt.sharding.world == 1
    x = torch.randn(8, 4)
    for _ in range(2):
        with opt.sampled_params(train=True):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert optimizer_state_bytes(opt) == opt.sharding.state_bytes_expected()
    with pytest.raises(ValueError, match="shard=True"):
        prepare_distributed(model, opt)


def test_sharded_prepare_takes_bucket_cap_mb_and_refuses_to_skip_the_consistency_check() -> None:
    """Sharded mode averages through its own RankAverager, which took neither argument: a given
    bucket_cap_mb was silently replaced by 64 MB, and check_consistency=False silently ignored (the
    check carries the ranks' agreement on a block that raised on one of them, so it cannot be skipped)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = build_optimizer(model, seed=0)
    with pytest.raises(ValueError, match=r"check_consistency=False .*sharded"):
        prepare_distributed(model, opt, shard=True, check_consistency=False)
    assert opt.sharding is None  # nothing installed
    prepare_distributed(model, opt, shard=True, bucket_cap_mb=0.5)
    assert opt.sharding.averager.bucket_cap_bytes == 2**19
    assert opt.sharding.averager.check_consistency is True


# ---------------------------------------------------------------------------- EVONTrainer
TRAINER_WORKER = os.path.join(HERE, "sharded_trainer_worker.py")


@pytest.fixture(scope="module")
def trainer_launches(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[int, tuple[str, Callable[[str], list[dict]]]]:
    """``tests/sharded_trainer_worker.py`` on 1 and 2 processes (the card and ``sharded_worker``'s run
    too, on 2, in the same launch): ``{world: (its output directory, load(scenario))}``."""
    out = {}
    for world, scenarios in ((1, ["runs"]), (2, ["runs", "card", "sharded"])):
        d = str(tmp_path_factory.mktemp(f"trainer{world}"))
        out[world] = d, scenario_results(world, TRAINER_WORKER, d, scenarios, timeout=180)
    return out


@pytest.fixture
def trainer_runs(trainer_launches) -> dict[int, tuple[str, list[dict]]]:
    """The ``runs`` scenario: ``{world: (its output directory, what each rank saved)}``."""
    return {world: (d, load("runs")) for world, (d, load) in trainer_launches.items()}


def test_trainer_two_ranks_equal_one_process_and_resume_exactly(trainer_runs) -> None:
    (_, (ref,)), (_, ranks) = trainer_runs[1], trainer_runs[2]
    for r in ranks:
        assert _max_rel(ref["weights"], r["weights"]) <= 1e-6
        assert all(
            torch.equal(r["weights"][k], r["resumed"][k]) for k in r["weights"]
        )  # resume_from_checkpoint
        assert all(torch.equal(ranks[0]["weights"][k], r["weights"][k]) for k in r["weights"])
    assert all(torch.equal(ref["weights"][k], ref["resumed"][k]) for k in ref["weights"])


def test_trainer_checkpoint_holds_the_unsharded_state_and_posterior(trainer_runs) -> None:
    ckpt = {w: os.path.join(trainer_runs[w][0], "first", "checkpoint-2") for w in (1, 2)}
    one, two = (torch.load(os.path.join(ckpt[w], "optimizer.pt"), weights_only=True) for w in (1, 2))
    assert one["state"].keys() == two["state"].keys() and len(one["state"]) == 16
    for i, st in one["state"].items():
        assert st.keys() == two["state"][i].keys()
        for k, v in st.items():
            torch.testing.assert_close(two["state"][i][k].to(v.device), v, rtol=1e-6, atol=1e-12)
    a, b = (EVONPosterior.from_pretrained(ckpt[w]).to_tensors() for w in (1, 2))
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("world", [2, 3])
def test_a_frozen_matrix_stays_put_and_the_rest_equals_one_process(runs, world: int) -> None:
    ref = runs[1][1][0]["frozen"]
    start = worker.tiny_model().state_dict()["6.weight"]
    for r in runs[world][1]:
        for a, b in zip(ref, r["frozen"]):
            assert _max_rel(a, b) <= 1e-6
            assert torch.equal(b["6.weight"], start)
    assert not torch.equal(ref[-1]["4.weight"], worker.tiny_model().state_dict()["4.weight"])


@pytest.mark.parametrize("world", [2, 3])
def test_health_statistics_pool_every_ranks_share(runs, world: int) -> None:
    ref = runs[1][1][0]["health"]
    assert ref and "noise_to_signal" in ref
    for r in runs[world][1]:
        assert r["health"].keys() == ref.keys()
        for k, v in ref.items():
            assert r["health"][k] == pytest.approx(v, rel=1e-6, abs=1e-12), k


def test_trainer_logged_statistics_pool_every_ranks_share(trainer_runs) -> None:
    ref = trainer_runs[1][1][0]["stats"]
    assert "evon/hess_mean" in ref and "evon/noise_to_signal" in ref
    for r in trainer_runs[2][1]:
        assert r["stats"].keys() == ref.keys()
        for k, v in ref.items():
            assert r["stats"][k] == pytest.approx(v, rel=1e-6, abs=1e-12), k


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_checkpoint_resumes_in_one_process(runs, world: int) -> None:
    """The gathered checkpoint is world-size independent: one process continues it like the
    one-process run (the unsharded format, so an unsharded EVON loads it too)."""
    ckpt = torch.load(os.path.join(runs[world][0], "checkpoint.pt"), weights_only=True)
    model, ddp, opt = worker.make(1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    worker.train(model, ddp, opt, worker.RESUME_AT, worker.STEPS, 0, 1)
    assert _max_rel(runs[1][1][0]["trace"][-1], model.state_dict()) <= 1e-6
    plain = build_optimizer(worker.tiny_model(), adamw_patterns=[r"^14\."], **worker.HP)
    plain.load_state_dict(ckpt["optim"])
    assert len(plain.state) == 16


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict]]:
    """``tests/sharded_fault_worker.py``'s refused steps, all in one 2-rank launch: ``faults(scenario)``
    is what each rank saved for it (a scenario that hangs is named in the launch's failure)."""
    import sharded_fault_worker as fw

    out = str(tmp_path_factory.mktemp("faults"))
    script = os.path.join(HERE, "sharded_fault_worker.py")
    return scenario_results(2, script, out, list(fw.SCENARIOS), timeout=120)


def test_a_step_without_samples_raises_on_every_rank_not_only_the_owners(faults) -> None:
    """Rank 1 owns no matrix: it must refuse the step too, not wait in a collective for ever."""
    results = faults("no_samples")
    assert [bool(r["message"]) for r in results] == [True, True]
    assert all("sampled_params" in r["message"] for r in results)


@pytest.mark.parametrize("scenario", ["no_grads", "ddp_no_grads"])
def test_a_rank_without_gradients_refuses_the_step_on_every_rank(faults, scenario: str) -> None:
    """Rank 1 skipped its backward (a loss guard), so it had no gradient: its averager returned before
    the structure check's all-reduce, rank 0's check met rank 1's next collective (its step paired with
    rank 1's next step, then it timed out; sharded, gloo aborted on mismatched sizes). Every rank now
    joins the check, which refuses the step on both, naming the disagreement, and neither steps."""
    results = faults(scenario)
    for r in results:
        assert "the ranks disagree on which gradients to average" in r["block_error"] + r["message"], r
        for key, value in r["before"].items():
            assert torch.equal(r["weights"][key], value), key


def test_a_rank_whose_gradients_are_all_zero_steps_with_the_others(faults) -> None:
    """Hand-made data parallelism: rank 1's loss times 0 gave it all-zero gradients, and its check of
    the local gradients skipped the all-reduce that rank 0 ran (gloo aborted on mismatched sizes).
    Both ranks step, on the same averaged gradients: equal weights."""
    results = faults("plain_zero_grads")
    assert [r["message"] for r in results] == ["", ""]
    for key, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][key], value), key
        assert not torch.equal(results[0]["before"][key], value), key  # the step was taken


def test_add_param_group_after_sharding_is_refused_on_every_rank(faults) -> None:
    """A group added after prepare_distributed(shard=True) has no owner: every rank updated its own
    copy from its own gradient and the ranks' weights parted (an EVON group's noise raised KeyError).
    It is refused, naming the call; the optimizer steps on as before, the ranks equal."""
    results = faults("add_group")
    for r in results:
        assert r["block_error"].startswith("EVON.add_param_group() after prepare_distributed(shard=True)"), r
        assert r["message"] == ""
    for key, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][key], value), key


def test_a_recast_parameter_refuses_the_step_on_every_rank_not_only_its_owner(faults) -> None:
    """Only rank 1 owns (holds the AdamW state of) the recast bias: before the fix it raised alone and
    rank 0 waited in the step's finiteness all-reduce for ever (the timeout fails it)."""
    results = faults("moved")
    assert [r["owner"] for r in results] == [False, True]
    assert "parameter 0.bias (shape (4,)) is torch.float32" in results[1]["message"]
    assert "rank 1" in results[0]["message"] and "parameter 0.bias (shape (4,)) is torch.float32" in results[0]["message"]


def test_a_parameter_recast_on_one_rank_refuses_the_unsharded_step_on_every_rank(faults) -> None:
    """Non-sharded DDP, rank 1 alone recast an AdamW bias to float32: before the fix its gradient went
    into a float32 flat buffer of its own on rank 1 only, so the ranks' averaging all-reduces did not
    pair (or, had they, rank 1 raised after them while rank 0 stepped). Now the structure check
    before them refuses the step on every rank, rank 0 naming rank 1 and the bias; no rank steps."""
    results = faults("ddp_moved")
    reason = "parameter 0.bias (shape (4,)) is torch.float32"
    assert results[1]["message"].startswith(f"EVON.step: {reason}"), results[1]["message"]
    assert results[0]["message"].startswith("rank 1 refused the step, so every rank does"), results[0]["message"]
    assert reason in results[0]["message"]
    for r in results:
        for k, v in r["before"].items():
            assert torch.equal(r["weights"][k], v.to(r["weights"][k].dtype)), k


def test_a_param_groups_edit_on_one_rank_refuses_the_sharded_step_on_every_rank(faults) -> None:
    """Rank 1 alone doubled the learning rate of the bias's group: before the fix the sharded averager
    compared no settings, both ranks stepped, and each owner applied its own rate. Now the step's
    agreed flag carries the settings' checksum: every rank refuses the step naming rank 1 and the
    group's lr, and no rank steps."""
    results = faults("param_edit")
    for r in results:
        assert "hyperparameters differ" in r["message"] and f"group {r['group']} lr" in r["message"], r["message"]
        assert "rank 1" in r["message"], r["message"]
        for k, v in r["before"].items():
            assert torch.equal(r["weights"][k], v), k


def test_a_block_that_raised_on_one_rank_is_recorded_on_no_rank(faults) -> None:
    """Rank 1's second block raised (and was caught): before the fix rank 0 averaged that block's
    gradients alone, its all-reduce met rank 1's next collective and gloo aborted rank 1 (SIGABRT,
    rank 0: "Connection reset by peer"). Now every rank learns it at the block's exit: rank 0's
    block raises naming rank 1, neither records it, and both take the same one-sample step."""
    results = faults("block_raised")
    assert "raised on rank 1, so this block is recorded on no rank" in results[0]["block_error"]
    assert results[1]["block_error"] == "a failed logging callback"
    assert [r["samples"] for r in results] == [1, 1] and [r["message"] for r in results] == ["", ""]
    for k, v in results[0]["weights"].items():
        assert torch.equal(v, results[1]["weights"][k]), k


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_block_that_raised_before_its_forward_stops_the_job_instead_of_hanging(tmp_path, kind: str) -> None:
    """Rank 1's block raised before its forward on a DDP model with a buffer, or an FSDP2 model (uncaught):
    its exit joined EVON's exchange while rank 0 was in the model's own forward collectives (DDP's buffer
    broadcast, FSDP2's all-gather), and both waited until the process group's timeout (30 minutes under
    gloo). A block that raised before its backward joins no exchange where the model runs collectives of
    its own: rank 1 exits with its error, and the launch stops rank 0 (as torchrun does)."""
    from launcher import torchrun

    with pytest.raises(AssertionError) as failed:
        torchrun(2, os.path.join(HERE, "sharded_raise_worker.py"), kind, timeout=90)
    message = str(failed.value)
    assert "still running after" not in message and "ValueError: rank 1 failed before its forward" in message, message


def test_a_refused_nonfinite_step_names_the_parameter_on_every_rank(faults) -> None:
    """Only rank 1 owns the bias whose squared gradient overflows: every rank refuses the step, and
    each names the bias (rank 0 said only "a non-finite value" before the fix)."""
    results = faults("overflow")
    assert [r["owner"] for r in results] == [False, True]
    for r in results:
        assert r["message"].startswith("overflow in AdamW's squared gradient of 0.bias (shape (4,))"), r["message"]


def test_create_model_card_on_every_rank_does_not_leave_rank_zero_waiting(trainer_launches) -> None:
    """transformers' scripts call ``create_model_card()`` on every process; its rank-0-only body
    must not gather the sharded posterior alone (a hang, before the fix: the timeout fails it)."""
    out, load = trainer_launches[2]
    assert load("card") == [{}, {}]
    with open(os.path.join(out, "card", "README.md")) as f:
        card = f.read()
    assert card.startswith("---") and "# sharded-card" in card
    assert "## EVON posterior (SOAP-Bubble)" in card


def test_a_sharded_step_agrees_in_one_all_reduce(faults) -> None:
    """A correct sharded step runs one all-reduce (the agreed flag: finite values, no refusal, the
    same settings) and no other; a refusal's agreement folded into the same flag, not a second
    all-reduce (and host read) per step."""
    results = faults("steady")
    assert [r["message"] for r in results] == ["", ""]
    assert [r["counts"] for r in results] == [{"all_reduce": 1, "all_ranks": 1}] * 2
