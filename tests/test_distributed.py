"""EVON under 2-process data parallelism (CPU, gloo), launched by ``accelerate launch``.

One launch of ``tests/distributed_worker.py`` runs every scenario; the checks here recompute
what each rank should have done from the raw material the ranks saved (their batches,
sampled weights and noise), independently of the optimizer's code.

Launch command: ``accelerate launch --multi_gpu --num_processes 2``. On a machine without
GPUs this starts 2 CPU processes (torchrun) and accelerate uses DDP over gloo; with accelerate
1.15 ``--cpu --num_processes 2`` starts a single process unless an MPI hostfile is given.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import load_script, plain_evon
from launcher import free_port, worker_env

from hf_evon import build_optimizer, prepare_distributed
from hf_evon.distributed.ddp import RankAverager, UnsupportedParallelismError
from hf_evon.optim import unwrap_optimizer

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed_worker.py")


worker = load_script(WORKER)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        WORKER,
        str(out),
    ]
    env = worker_env()
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    print(f"2-process worker: {time.time() - start:.1f}s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def local_gradients(weights: dict, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's own gradient at its sampled weights, recomputed here on a plain model."""
    model = worker.tiny_gpt2()
    model.load_state_dict(weights)
    for ids in batches:  # accelerate scales each micro-batch loss by 1/MICRO
        (model(input_ids=ids, labels=ids).loss / worker.MICRO).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _rot(x, ql, qr):
    return ql.mT @ x @ qr


def test_world_and_seed(ranks: list[dict]) -> None:
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["seed_before"] != ranks[1]["seed_before"]
    # every rank gets rank 0's seed (reproducible job), the streams still differ by rank
    assert ranks[0]["seed_after"] == ranks[1]["seed_after"] == ranks[0]["seed_before"]


def test_local_gradients_are_each_ranks_own(ranks: list[dict]) -> None:
    """DDP must not average during backward: p.grad is exactly the rank's own gradient."""
    for step in range(1, 6):
        grads = []
        for r in ranks:
            rec = r["steps"][step]
            expect = local_gradients(rec["sampled_weights"], rec["batches"])
            for name, g in rec["local_grad"].items():
                torch.testing.assert_close(g, expect[name], rtol=1e-10, atol=1e-13)
            grads.append(rec["local_grad"])
        assert all(not torch.allclose(grads[0][n], grads[1][n]) for n in grads[0])


def test_noise_differs_between_ranks(ranks: list[dict]) -> None:
    for step in range(1, 6):
        n0, n1 = ranks[0]["steps"][step]["noise"], ranks[1]["steps"][step]["noise"]
        assert n0 and n0.keys() == n1.keys()
        for name in n0:
            a, b = n0[name].flatten(), n1[name].flatten()
            corr = float(torch.dot(a, b) / (a.norm() * b.norm()))
            assert abs(corr) < 0.5, (step, name, corr)  # independent draws, not copies or sign flips
        # and the sampled weights of the EVON matrices differ between ranks
        w0, w1 = ranks[0]["steps"][step]["sampled_weights"], ranks[1]["steps"][step]["sampled_weights"]
        assert not torch.equal(w0["transformer.h.0.mlp.c_fc.weight"], w1["transformer.h.0.mlp.c_fc.weight"])


def test_hessian_is_mean_of_each_ranks_own_estimate(ranks: list[dict]) -> None:
    """H_new from Ĥ = mean_r G°_r ⊙ E_r / V, G_r recomputed here; momentum from mean_r G°_r."""
    hp = ranks[0]["hparams"]
    beta1, beta2 = hp["betas"]
    ess, delta = hp["ess"], hp["weight_decay"]
    checked = 0
    for step in range(1, 6):
        recs = [r["steps"][step] for r in ranks]
        grads = [local_gradients(rec["sampled_weights"], rec["batches"]) for rec in recs]
        for name in recs[0]["noise"]:
            key = f"0.{name}"
            before, after = recs[0]["before"], recs[0]["after"]
            assert all(torch.equal(rec["before"][f"{key}.hess"], before[f"{key}.hess"]) for rec in recs)
            hess = before[f"{key}.hess"]
            ql, qr = before[f"{key}.Q_L"], before[f"{key}.Q_R"]
            var = 1.0 / (ess * (hess + delta))
            g_rot = [_rot(g[name], ql, qr) for g in grads]
            h_hats = [gr * rec["noise"][name] / var for gr, rec in zip(g_rot, recs)]
            h_hat = sum(h_hats) / len(h_hats)
            expect = (
                beta2 * hess
                + (1 - beta2) * h_hat
                + 0.5 * (1 - beta2) ** 2 * (hess - h_hat) ** 2 / (hess + delta)
            )
            torch.testing.assert_close(after[f"{key}.hess"], expect, rtol=1e-9, atol=1e-12)
            # negative control: Ĥ from DDP's averaged gradient would be measurably different
            g_mean = sum(g_rot) / 2
            wrong = sum(g_mean * rec["noise"][name] / var for rec in recs) / 2
            wrong_h = (
                beta2 * hess
                + (1 - beta2) * wrong
                + 0.5 * (1 - beta2) ** 2 * (hess - wrong) ** 2 / (hess + delta)
            )
            assert (wrong_h - after[f"{key}.hess"]).abs().max() > 1e3 * (
                expect - after[f"{key}.hess"]
            ).abs().max()
            # momentum: the mean rotated gradient, re-expressed in the refreshed basis if one happened
            m = beta1 * before[f"{key}.exp_avg"] + (1 - beta1) * sum(g_rot) / 2
            nl, nr = after[f"{key}.Q_L"], after[f"{key}.Q_R"]
            m = nl.mT @ ql @ m @ qr.mT @ nr
            torch.testing.assert_close(after[f"{key}.exp_avg"], m, rtol=1e-8, atol=1e-12)
            checked += 1
    assert checked == 5 * 4  # 4 EVON matrices in the tiny GPT-2, 5 noisy steps


def test_adamw_parameters_averaged_like_ddp(ranks: list[dict]) -> None:
    """AdamW-owned parameters (embeddings, head, norms) see the plain mean gradient."""
    recs = [r["steps"][3] for r in ranks]
    grads = [local_gradients(rec["sampled_weights"], rec["batches"]) for rec in recs]
    for name in ("transformer.wte.weight", "transformer.ln_f.weight", "transformer.h.0.attn.c_attn.bias"):
        key = next(k for k in recs[0]["after"] if k.endswith(f".{name}.exp_avg") and not k.startswith("0."))
        mean = (grads[0][name] + grads[1][name]) / 2
        expect = 0.9 * recs[0]["before"][key] + 0.1 * mean
        torch.testing.assert_close(recs[0]["after"][key], expect, rtol=1e-9, atol=1e-13)
        assert not torch.allclose(recs[0]["after"][key], 0.9 * recs[0]["before"][key] + 0.1 * grads[0][name])


def test_ranks_identical_after_every_step(ranks: list[dict]) -> None:
    for step in range(6):
        a, b = ranks[0]["steps"][step], ranks[1]["steps"][step]
        for key in a["mean_weights"]:
            assert torch.equal(a["mean_weights"][key], b["mean_weights"][key]), (step, key)
        for key in a["after"]:
            assert torch.equal(a["after"][key], b["after"][key]), (step, key)
    for key in ranks[0]["final_state"]:
        assert torch.equal(ranks[0]["final_state"][key], ranks[1]["final_state"][key]), key
    moved = [
        k
        for k in ranks[0]["final_weights"]
        if not torch.equal(ranks[0]["final_weights"][k], ranks[0]["initial"][k])
    ]
    assert len(moved) > 10  # the equality is not that of untouched weights


def test_synchronize_once_per_step_with_accumulation(ranks: list[dict]) -> None:
    # 6 optimizer steps of 2 accumulated micro-batches each: 6 reductions, not 12
    assert ranks[0]["reducer_calls"] == ranks[1]["reducer_calls"] == 6


def test_parameters_are_checked_for_a_move_once_per_step(ranks: list[dict]) -> None:
    """Unsharded DDP: the averaging looks for a recast or moved parameter before its all-reduces, and
    EVON's step looked again for the same parameters right after it (12 checks in 6 steps)."""
    assert [r["moved_checks"] for r in ranks] == [6, 6]


def test_a_step_after_an_early_synchronize_checks_the_parameters_for_a_move_once(ranks: list[dict]) -> None:
    """The Trainer synchronizes before its step, to clip: the averaging looked for a recast or moved
    parameter, and the step looked again for the same parameters (4 checks in 2 steps)."""
    assert [r["early_synchronize_moved_checks"] for r in ranks] == [2, 2]


def test_a_parameter_recast_after_an_early_synchronize_still_refuses_the_step(ranks: list[dict]) -> None:
    """``synchronize()`` (the Trainer's, to clip) checked the parameters, and then the model's final
    bias was recast: the step refuses, naming it, and no weight moves."""
    for r in ranks:
        assert r["error_recast"] is not None, r["error_recast"]
        assert r["error_recast"].startswith(
            "RuntimeError: EVON.step: parameter transformer.ln_f.bias (shape (12,)) is torch.float32 on cpu, "
            "but its state 'exp_avg' is torch.float64"
        ), r["error_recast"]
        assert r["recast_kept"] is True


def test_two_ranks_match_one_process_with_double_batch(ranks: list[dict]) -> None:
    """Deterministic mode (ess=inf): 2 ranks x batch 4 == 1 process x batch 8.

    What is exactly equal: the data, the initial weights and the algorithm. What is not: the
    float summation order (one reduction over 8 sequences vs. (mean_4 + mean_4) / 2), so each
    gradient entry differs by a few ulps (~1e-16 relative in float64). EVON amplifies that
    where its statistics are rank-deficient: R = Σ GᵀG of a 12×36 gradient has rank ≤ 12, so
    the eigenbasis inside the null space is not unique and eigh/QR may return any rotation of
    it (Q_R and the rotated-space momentum/Hessian then differ by O(1), harmlessly, since
    nothing lives there yet). So we compare basis-independent quantities: the weights, L, R,
    the momentum in parameter space (Q_L Ḡ Q_Rᵀ, as the per-matrix step keeps it) and the AdamW state. Measured:
    ≤ 5e-8 of each tensor's scale after 5 steps; we allow 1e-6 of the scale, and check that a
    run which saw only one rank's half of the batch is > 1e-3 of the scale away.
    """
    model = worker.tiny_gpt2()
    opt = build_optimizer(model, **worker.deterministic_hparams())
    half = worker.tiny_gpt2()
    half_opt = build_optimizer(half, **worker.deterministic_hparams())
    for step in range(5):
        ids = worker.global_batch(step, 8)
        for m, o, x in ((model, opt, ids), (half, half_opt, ids[:4])):
            with o.sampled_params(train=True):
                m(input_ids=x, labels=x).loss.backward()
            o.step()
            o.zero_grad()

    def invariant(weights: dict, state: dict) -> dict[str, torch.Tensor]:
        out = {f"w.{k}": v for k, v in weights.items()}
        for key, value in state.items():
            if key.endswith((".L", ".R", ".exp_avg_sq", ".exp_avg_unrotated")) or (
                key.endswith(".exp_avg") and not key.startswith("0.")
            ):
                out[key] = value  # the per-matrix step's momentum is in the weights' space already
            elif key.endswith(".exp_avg"):  # the per-entry step's is in the eigenbasis: map it back
                base = key[: -len(".exp_avg")]
                out[f"{base}.momentum"] = state[f"{base}.Q_L"] @ value @ state[f"{base}.Q_R"].mT
        return out

    ref = invariant(model.state_dict(), worker.evon_state(opt))
    other = invariant(half.state_dict(), worker.evon_state(half_opt))
    assert len(ref) == len(model.state_dict()) + 4 * 3 + 12 * 2  # EVON: L, R, momentum; AdamW: m, v
    for r in ranks:
        got = invariant(r["det_weights"], r["det_state"])
        assert got.keys() == ref.keys()
        for key, value in got.items():
            scale = float(ref[key].abs().max())
            assert float((value - ref[key]).abs().max()) <= 1e-6 * scale, key
    far = [k for k in ref if float((other[k] - ref[k]).abs().max()) > 1e-3 * float(ref[k].abs().max())]
    assert len(far) == len(ref), sorted(set(ref) - set(far))


def test_forgetting_prepare_distributed_raises(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["error_forgot"] is not None and "prepare_distributed" in r["error_forgot"]
        assert r["error_forgot"].startswith("RuntimeError")


def test_a_sample_that_failed_on_one_rank_refuses_the_step_on_every_rank(ranks: list[dict]) -> None:
    """Issue 33 item 10: a block that raised (and was caught) on one rank only left it with one
    recorded sample fewer, and each rank divided the averaged sum by its own count: the ranks
    drifted apart silently. Now every rank refuses the step naming the counts, drops its samples,
    and later steps keep the ranks in sync (``check_ranks_in_sync`` inside the worker)."""
    for r in ranks:
        assert r["error_samples"] is not None and "between 1 and 2" in r["error_samples"], r["error_samples"]
        assert r["error_samples"].startswith("RuntimeError")
        assert r["samples_after_refusal"] == 0


def test_ranks_with_different_hyperparameters_refuse_the_first_step(ranks: list[dict]) -> None:
    """Issue 33 item 13: ranks built with different rates (or ess, mc_samples...) drifted apart
    silently. Every rank refuses the step, naming what differs."""
    for r in ranks:
        err = r["error_hyperparameters"]
        assert err is not None and err.startswith("RuntimeError") and "hyperparameters differ" in err, err
        assert "group 0 lr" in err


def test_preparing_the_unwrapped_module_is_detected(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["error_unwrapped"] is not None and "averaged them" in r["error_unwrapped"]


def test_ranks_disagreeing_on_gradients_raise_instead_of_hanging(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["error_mismatch"] is not None and "disagree" in r["error_mismatch"]


def test_ddp_join_with_uneven_inputs_is_refused_on_every_rank(ranks: list[dict]) -> None:
    """``with model.join():`` (DDP's; ``accelerator.join_uneven_inputs(..., even_batches=False)`` on
    GPUs), rank 1 one batch short: the joined rank's loop shadows DDP's collectives, not EVON's step,
    so its join all-reduces paired with rank 0's step (gloo aborted: "Received data size doesn't
    match expected size"; elsewhere rank 1 left the join while rank 0 hung in its step). Every rank
    now refuses the first step inside the join, naming it, plain and sharded."""
    for r in ranks:
        for key in ("error_join", "error_join_sharded"):
            assert r[key] is not None and r[key].startswith("RuntimeError: "), (key, r[key])
            assert "join context" in r[key] and "throw_on_early_termination=True" in r[key], r[key]
        assert r["error_join"] == ranks[0]["error_join"]


def test_uneven_batches_are_refused_on_every_rank_before_any_update(ranks: list[dict]) -> None:
    """``even_batches=False``, 5 batches over 2 ranks (rank 0: 3, rank 1: 2): rank 0's third step
    waited in EVON's all-reduce for rank 1, which had left the loop (gloo: "Timed out waiting ...
    for recv operation", after the process group's timeout, 30 minutes by default). Every rank now
    refuses the first step, naming each rank's count and the setting, plain and sharded."""
    for r in ranks:
        for key in ("error_uneven_batches", "error_uneven_batches_sharded"):
            assert r[key] is not None and r[key].startswith("RuntimeError: EVON: "), (key, r[key])
            assert "different numbers of batches ([3, 2], by rank" in r[key] and "even_batches" in r[key], r[key]
            assert r[key] == ranks[0][key]
        assert r["uneven_batches_untouched_False"] and r["uneven_batches_untouched_True"]


def test_a_group_without_gradients_adds_no_collectives_and_keeps_the_ranks_equal(ranks: list[dict]) -> None:
    """A frozen layer's weight in a group of its own waits for a gradient that never comes. Its
    clock restarts at every update; each restart used to be a curvature fit with a pooled
    reduction, a collective on every rank at every update (8 where the other groups' fits make 6
    in these 6 steps). Now both ranks pool exactly as often as without that group, and end with
    the same weights as each other and as that run."""
    for r in ranks:
        assert r["unused_group_pools_False"] > 0
        assert r["unused_group_pools_True"] == r["unused_group_pools_False"]
        for key, value in r["unused_group_weights_True"].items():
            assert torch.equal(value, ranks[0]["unused_group_weights_True"][key]), key
            assert torch.equal(value, r["unused_group_weights_False"][key]), key


def test_fsdp_is_refused(ranks: list[dict]) -> None:
    for r in ranks:
        assert (
            r["error_fsdp1"]
            and r["error_fsdp1"].startswith("UnsupportedParallelismError")
            and "FSDP" in r["error_fsdp1"]
        )
        assert (
            r["error_fsdp2"]
            and r["error_fsdp2"].startswith("UnsupportedParallelismError")
            and "FSDP2" in r["error_fsdp2"]
            and "parameter 'transformer." in r["error_fsdp2"]  # names a sharded parameter
            and "shard=True" in r["error_fsdp2"]  # and what is supported
        )


# ---------------------------------------------------------------- single-process unit checks
def test_single_process_prepare_is_a_noop_and_unwraps() -> None:
    model = worker.tiny_gpt2()
    opt = build_optimizer(model, **plain_evon(ess=100.0))

    class Wrapper:  # like accelerate's AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    wrapper = Wrapper(opt)
    assert prepare_distributed(model, wrapper) is wrapper  # the same handle, now with EVON's API
    assert isinstance(wrapper, Wrapper) and wrapper.mc_samples == opt.mc_samples
    assert wrapper.sampled_params.__self__ is opt
    assert prepare_distributed(model, opt) is opt
    assert opt.gradient_reducer is None
    assert unwrap_optimizer(Wrapper(Wrapper(opt))) is opt
    with pytest.raises(TypeError, match="EVON"):
        prepare_distributed(model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shard": "no"}, r"shard must be True, False or None; got 'no'"),  # truthy: sharded for good
        ({"check_consistency": "no"}, r"check_consistency must be True or False"),
        ({"bucket_cap_mb": -1}, r"bucket_cap_mb must be a finite number > 0; got -1"),
    ],
)
def test_prepare_distributed_refuses_bad_arguments_and_another_models_optimizer(kwargs, match) -> None:
    model = worker.tiny_gpt2()
    opt = build_optimizer(model, **plain_evon(ess=100.0))
    with pytest.raises((TypeError, ValueError), match=match):
        prepare_distributed(model, opt, **kwargs)
    assert opt.sharding is None  # nothing installed
    with pytest.raises(ValueError, match=r"trains \d+ tensor\(s\) that are not parameters of the given Linear"):
        prepare_distributed(torch.nn.Linear(3, 3), opt)


def test_deepspeed_engine_is_refused() -> None:
    class DeepSpeedEngine(torch.nn.Module):  # stands in for deepspeed's engine (matched by name)
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    model = worker.tiny_gpt2()
    with pytest.raises(UnsupportedParallelismError, match="DeepSpeed"):
        prepare_distributed(
            DeepSpeedEngine(model),
            build_optimizer(model, **plain_evon(ess=100.0)),
        )


def test_deepspeed_zero_flat_partitions_are_refused_as_deepspeed() -> None:
    """ZeRO (stages 1 and 2) puts its flat fp32 partitions into the optimizer's param groups: the
    check for another model's tensors ran first and said "pass the model it was built for", on a
    DeepSpeed engine that was the right one. DeepSpeed is now named."""

    class DeepSpeedEngine(torch.nn.Module):  # stands in for deepspeed's engine (matched by name)
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    model = worker.tiny_gpt2()
    opt = build_optimizer(model, **plain_evon(ess=100.0))
    for group in opt.param_groups:  # as DeepSpeedZeroOptimizer does: one flat partition per group
        group["params"] = [torch.cat([p.detach().reshape(-1) for p in group["params"]]).requires_grad_()]
    with pytest.raises(UnsupportedParallelismError, match="EVON cannot run under DeepSpeed"):
        prepare_distributed(DeepSpeedEngine(model), opt)
    assert opt.sharding is None and opt.gradient_reducer is None


@pytest.mark.parametrize(
    ("flag", "match"),
    [
        ("is_deepspeed_enabled", r"cannot train under DeepSpeed \(TrainingArguments\.deepspeed"),
        ("is_fsdp_enabled", r"cannot train under FSDP1 .*fsdp_version"),
    ],
)
def test_trainer_refuses_deepspeed_and_fsdp1_before_building_anything(tmp_path, flag, match) -> None:
    """accelerate's DeepSpeed or FSDP1 plugin (``is_deepspeed_enabled``/``is_fsdp_enabled`` set, as
    the Trainer sets them from accelerate's state; neither plugin runs on CPUs, and deepspeed is not
    installed, so the flags stand in for them). Before, DeepSpeed built EVON for its ZeRO wrapper (or
    trained its config's own optimizer without EVON) and the first refusal, if any, came later and named
    another model's tensors; FSDP1 built EVON on its flat parameters. Both are refused in ``train()``
    now, naming the setting, before the optimizer is built."""
    from test_trainer import config, lm_data, tiny_gpt2

    from hf_evon import EVONTrainer

    trainer = EVONTrainer(model=tiny_gpt2(), args=config(tmp_path, max_steps=1), train_dataset=lm_data(4))
    setattr(trainer, flag, True)
    with pytest.raises(UnsupportedParallelismError, match=match):
        trainer.train()
    assert trainer.optimizer is None and trainer.state.global_step == 0


def test_rank_averager_packs_by_dtype_and_cap() -> None:
    avg = RankAverager(bucket_cap_mb=1e-4)  # ~100 bytes per flat buffer
    ts = [torch.ones(10), torch.ones(3), torch.ones(20, dtype=torch.float64), torch.ones(30)]
    buckets = avg._buckets(ts)
    assert all(len({t.dtype for t in b}) == 1 for b in buckets)
    assert sorted(len(b) for b in buckets) == [1, 1, 2]  # 40 B + 12 B share one; + 120 B would pass ~105 B
    assert sum(len(b) for b in buckets) == len(ts)
    assert math.isclose(avg.bucket_cap_bytes, 1e-4 * 2**20, abs_tol=1)


def test_the_ranks_settings_checksum_reads_neither_a_tensor_rates_device_nor_its_value() -> None:
    """The ranks compare a checksum of their group settings every step (the DDP averager, sharded
    EVON's agreed flag). A tensor rate went in as its repr, which names its device and reads its value:
    each GPU rank's rate on its own device (cuda:0, cuda:1) made a checksum of its own, so every step
    was refused as "the ranks' hyperparameters differ", and the value came back to the host every
    step. A tensor setting now counts by its dtype and shape (a rate on the device is read at set-up
    only); a number is still compared by value."""
    from hf_evon.distributed.averaging import settings_key

    model = worker.tiny_gpt2()
    opt = build_optimizer(model, **plain_evon(ess=100.0))
    keys = {}
    for device in ("cpu", "meta"):  # meta: a device whose value no read can reach, as another rank's GPU
        for group in opt.param_groups:
            group["lr"] = torch.tensor(1e-3, device=device)
            group["betas"] = (torch.tensor(0.9, device=device), 0.999)
        keys[device] = settings_key(opt)[1]
    assert keys["cpu"] == keys["meta"]
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, dtype=torch.float64)
    assert settings_key(opt)[1] != keys["cpu"]
    opt.param_groups[0]["lr"], opt.param_groups[0]["betas"] = 1e-3, (0.9, 0.999)
    number = settings_key(opt)[1]
    opt.param_groups[0]["lr"] = 2e-3
    assert settings_key(opt)[1] != number


def _accelerate_run(use_accelerate: bool, micro: int, distributed: bool = True) -> dict[str, torch.Tensor]:
    """Three EVON steps of 2 samples over ``micro`` accumulated micro-batches: through one
    accelerate-prepared handle (then through prepare_distributed unless ``distributed`` is
    False), or with the bare EVON (loss / micro, as accelerate scales it)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    model = worker.tiny_gpt2()
    optimizer = build_optimizer(model, lr=0.05, ess=500.0, mc_samples=2, precondition_frequency=2, seed=3)
    batches = [[torch.randint(0, 32, (2, 6)) for _ in range(micro)] for _ in range(3)]
    if not use_accelerate:
        for step_batches in batches:
            for _ in range(optimizer.mc_samples):
                with optimizer.sampled_params(train=True):
                    for ids in step_batches:
                        (model(input_ids=ids, labels=ids).loss / micro).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.clone() for k, v in model.state_dict().items()}
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=micro)
        model, optimizer = accelerator.prepare(model, optimizer)
        if distributed:
            optimizer = prepare_distributed(model, optimizer)  # the README's accelerate loop, one handle
        for step_batches in batches:
            for _ in range(optimizer.mc_samples):
                with optimizer.sampled_params(train=True):
                    for ids in step_batches:
                        with accelerator.accumulate(model):
                            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
        expected_type = "EVONAcceleratedOptimizer" if distributed else "AcceleratedOptimizer"
        assert type(optimizer).__name__ == expected_type
        return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize("micro", [1, 2])
def test_prepared_accelerate_optimizer_is_one_handle(micro: int) -> None:
    """accelerate's AcceleratedOptimizer, once through prepare_distributed, samples as EVON
    does and steps as accelerate does: the weights equal the bare EVON loop's bit for bit."""
    from accelerate.optimizer import AcceleratedOptimizer

    from hf_evon.distributed.ddp import EVONAcceleratedOptimizer

    assert issubclass(EVONAcceleratedOptimizer, AcceleratedOptimizer)
    expected = _accelerate_run(False, micro)
    got = _accelerate_run(True, micro)
    assert set(got) == set(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_a_block_after_a_step_short_of_its_micro_batches_is_refused_naming_that_step() -> None:
    """The docs' layout (a step's micro-batches inside each sample's block) with a step of fewer than
    gradient_accumulation_steps micro-batches (an epoch's last, 3 batches at K = 2) leaves accelerate's
    counter mid-step: it skips that optimizer.step() and zero_grad(), and the next block is refused. The
    refusal said the block was "entered inside accelerator.accumulate(model)", which it was not, and
    told the user to use the layout they were using; it names the short step too."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        torch.manual_seed(0)
        model = worker.tiny_gpt2()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, optimizer = accelerator.prepare(model, build_optimizer(model, ess=500.0))
        batches = [torch.randint(0, 32, (2, 6)) for _ in range(5)]
        for step_batches in (batches[:2], batches[2:3]):  # the second step is short: accelerate skips it
            with optimizer.sampled_params(train=True):
                for ids in step_batches:
                    with accelerator.accumulate(model):
                        accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match="gradient_accumulation_steps=2") as refused:
            with optimizer.sampled_params(train=True):
                pass
        assert "after a step of fewer than 2 micro-batches" in str(refused.value)
        assert optimizer.recorded_samples == 1  # the short step's block, which accelerate did not step
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_accelerate_prepare_alone_answers_evons_api() -> None:
    """``accelerator.prepare(build_optimizer(model))`` without prepare_distributed (one process):
    the AcceleratedOptimizer answers ``mc_samples`` and ``sampled_params`` from its EVON, and the
    loop's weights equal the bare EVON loop's bit for bit; around another optimizer a missing
    attribute is still Python's AttributeError. accelerate defines no __getattr__ of its own (the
    one hf_evon installs is EVONHandle's: if accelerate ever adds one, this fails)."""
    from accelerate.optimizer import AcceleratedOptimizer

    from hf_evon.optim import EVONHandle

    assert AcceleratedOptimizer.__getattr__ is EVONHandle.__getattr__
    paths = [("hf_evon", "build_optimizer"), ("hf_evon.optim", "EVON"), ("hf_evon.optim.evon", "EVON")]
    for public, name in paths + [("hf_evon.optim.grouping", "build_optimizer")]:
        fresh = (  # a user's script imports the optimizer by one path and accelerate after it
            f"from {public} import {name}\n"
            "from accelerate.optimizer import AcceleratedOptimizer\n"
            "print(getattr(AcceleratedOptimizer.__dict__.get('__getattr__'), '__qualname__', None))\n"
        )
        out = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "EVONHandle.__getattr__", public
    expected = _accelerate_run(False, 2)
    got = _accelerate_run(True, 2, distributed=False)
    assert set(got) == set(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    adamw = object.__new__(AcceleratedOptimizer)  # as unpickling builds it: no Accelerator needed
    adamw.__setstate__({"optimizer": torch.optim.AdamW(worker.tiny_gpt2().parameters()), "scaler": None})
    with pytest.raises(AttributeError, match="^'AcceleratedOptimizer' object has no attribute 'mc_samples'$"):
        adamw.mc_samples  # noqa: B018


def test_unwrap_optimizers_old_import_path_warns_and_gives_the_one_in_hf_evon_optim() -> None:
    import hf_evon.distributed as distributed

    with pytest.warns(DeprecationWarning, match=r"is hf_evon\.optim\.unwrap_optimizer: import it from there"):
        moved = distributed.unwrap_optimizer
    assert moved is unwrap_optimizer and "unwrap_optimizer" not in distributed.__all__
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        distributed.nothing_here  # noqa: B018


def test_handle_forwards_only_what_the_wrapper_lacks_and_pickles() -> None:
    import pickle

    model = worker.tiny_gpt2()
    opt = build_optimizer(model, ess=100.0)

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            return "wrapper's step"

    wrapper = prepare_distributed(model, Wrapper(opt))
    assert wrapper.step() == "wrapper's step" and wrapper.posterior_std == opt.posterior_std
    with pytest.raises(AttributeError, match="no_such_thing"):
        wrapper.no_such_thing  # noqa: B018
    assert prepare_distributed(model, wrapper) is wrapper and type(wrapper).__mro__[2] is Wrapper
    with pytest.raises(TypeError, match="EVON"):
        prepare_distributed(model, Wrapper(torch.optim.AdamW(model.parameters())))
    from hf_evon.distributed.ddp import EVONAcceleratedOptimizer

    handle = object.__new__(EVONAcceleratedOptimizer)
    handle.__setstate__({"optimizer": opt, "scaler": None})
    copied = pickle.loads(pickle.dumps(handle))
    assert type(copied) is EVONAcceleratedOptimizer and copied.mc_samples == opt.mc_samples


def test_a_skipped_evon_step_is_reported_to_accelerate_and_its_scheduler() -> None:
    """EVON skips a step with a non-finite gradient (weights unchanged): accelerate's
    step_was_skipped said False (it knows only a GradScaler's skips), so the prepared scheduler and
    the Trainer's advanced the learning rate for a step that did not happen."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        torch.manual_seed(0)
        model = worker.tiny_gpt2()
        optimizer = build_optimizer(model, seed=0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        accelerator = Accelerator(cpu=True)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        optimizer = prepare_distributed(model, optimizer)
        ids = torch.randint(0, 32, (2, 6))

        def train(model, optimizer, scheduler, scales) -> None:  # noqa: ANN001
            for scale in scales:
                with optimizer.sampled_params(train=True):
                    accelerator.backward(model(input_ids=ids, labels=ids).loss * scale)
                before = [g["lr"] for g in optimizer.param_groups]
                with pytest.warns(RuntimeWarning, match="skipped") if scale != scale else contextlib.nullcontext():
                    optimizer.step()
                assert optimizer.step_was_skipped == (scale != scale)
                scheduler.step()
                optimizer.zero_grad()
                assert ([g["lr"] for g in optimizer.param_groups] == before) == (scale != scale)

        train(model, optimizer, scheduler, (1.0, 1.0, math.nan))
        # a copy (deepcopy, pickle) lost its EVON's step hooks, and its step_was_skipped kept the value it
        # was copied with: True after every later step of a copy made here (its scheduler never advanced)
        copied = copy.deepcopy((model, optimizer, scheduler))
        train(model, optimizer, scheduler, (1.0,))
        again = copy.deepcopy((model, optimizer, scheduler))  # made after a good step: False for a skipped one
        train(*copied, (1.0, math.nan, 1.0))
        train(*again, (math.nan, 1.0))
        assert unwrap_optimizer(optimizer).skipped_steps == 1
        assert [unwrap_optimizer(c[1]).skipped_steps for c in (copied, again)] == [2, 2]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


# ---------------------------------------------------------------- EVONTrainer under torchrun
def _max_rel_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def test_trainer_under_ddp_accumulates_resumes_across_world_sizes_and_saves_once(tmp_path) -> None:
    """``EVONTrainer`` on 2 gloo ranks (torchrun) with gradient_accumulation_steps=2 and
    evon_mc_samples=2, plain (ess=inf) and evon_shard=True (noisy, whose noise is the one process's):
    the weights equal one process's with the same global batch; a 2-rank checkpoint resumes in one
    process, and a one-process checkpoint on 2 ranks, to the same weights; the posterior at the end
    is written by rank 0 only, and after a sharded run rank 0 alone can save it; evaluate()'s metrics are
    the same on both ranks, and its BMA metrics those of one process. Before, ``save_model()`` on rank 0
    alone after an evon_shard=True run waited for ever in a gather of the sharded state."""
    import trainer_ddp_worker as tw
    from launcher import torchrun

    one, one_eval = {}, {}
    for shard in (False, True):
        name = "shard" if shard else "plain"
        trainer = tw.train(tmp_path / f"one_{name}", 1, shard)
        one[name], one_eval[name] = tw.weights(trainer), trainer.evaluate(bma=True)
        one[f"{name}_logs"] = tw.training_logs(trainer)
        one[f"{name}_calibration"] = None if trainer.calibration is None else vars(trainer.calibration)
    torchrun(2, os.path.join(HERE, "trainer_ddp_worker.py"), HERE, str(tmp_path), timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    def metrics(logged: dict) -> dict:  # not the timings
        return {k: v for k, v in logged.items() if not k.endswith(("_runtime", "_per_second"))}

    start = tw.tiny_gpt2().double().state_dict()
    for name in ("plain", "shard"):
        assert not torch.equal(one[name]["transformer.h.0.mlp.c_fc.weight"], start["transformer.h.0.mlp.c_fc.weight"])
        for r in ranks:
            assert _max_rel_error(r[f"{name}_weights"], one[name]) <= 1e-6, name
            assert _max_rel_error(r[f"{name}_resumed"], one[name]) <= 1e-6, name
            assert metrics(r[f"{name}_eval"]) == metrics(ranks[0][f"{name}_eval"]), name
            assert r[f"{name}_calibration"] == ranks[0][f"{name}_calibration"], name
            logs, want_logs = r[f"{name}_logs"], one[f"{name}_logs"]
            assert len(logs) == len(want_logs) == tw.STEPS // 2
            for got, want in zip(logs, want_logs):  # the loss, grad_norm and EVON's statistics
                assert got.keys() == want.keys() and {"loss", "grad_norm", "evon/hess_mean"} <= got.keys()
                for key, value in want.items():
                    assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (name, key, got, want)
        got, want = metrics(ranks[0][f"{name}_eval"]), metrics(one_eval[name])
        assert got.keys() == want.keys() and "eval_bma_nll" in got
        bma = [k for k in want if k.startswith("eval_bma_")]  # eval_loss is the Trainer's mean of batch means
        assert bma
        for key in bma:  # the posterior's seeded samples: those of one process
            assert got[key] == pytest.approx(want[key], rel=1e-6), (name, key, got, want)
        assert ranks[0][f"{name}_files"] == ranks[1][f"{name}_files"]
        assert {"evon_posterior.safetensors", "evon_posterior_config.json"} <= set(ranks[0][f"{name}_files"])
        assert not [f for f in ranks[0][f"{name}_files"] if "tmp" in f or f.startswith(".")], ranks[0][f"{name}_files"]
        # a 2-rank checkpoint resumed in one process
        resumed = tw.train(tmp_path / f"back_{name}", 1, name == "shard",
                           resume=str(tmp_path / f"two_{name}" / "out" / "checkpoint-2"))  # fmt: skip
        assert _max_rel_error(tw.weights(resumed), one[name]) <= 1e-6, name
    # the sharded runs calibrate at the end of training: every rank scores the whole split, as one process
    got, want = ranks[0]["shard_calibration"], one["shard_calibration"]
    assert want is not None and want["num_targets"] == got["num_targets"] > 0 and got["ess"] == want["ess"]
    assert got["nll"] == pytest.approx(want["nll"], rel=1e-6)
    assert ranks[1]["saves"] == []  # only the process that saves writes posteriors
    # rank 0 alone saves the sharded run's model and posterior, without waiting for rank 1
    assert ranks[0]["rank0_save"] is None
    final = tmp_path / "rank0_save" / "final"
    assert {"model.safetensors", "evon_posterior.safetensors", "evon_posterior_config.json"} <= set(os.listdir(final))
    assert ranks[0]["saves"] and all(s.startswith(str(tmp_path)) for s in ranks[0]["saves"])


def test_the_uneven_batches_check_remembers_loaders_not_their_addresses(monkeypatch) -> None:
    """The check kept the ``id`` of each loader it had compared: a new loader at a freed one's address
    (CPython reuses them) was skipped on one rank and compared on another, whose all-gather then waited
    for ever. It now remembers the loader objects themselves (weakly): every new loader is compared
    once, on every rank alike. One process, the all-gather counted; the address reuse is forced."""
    import accelerate.state

    from hf_evon.distributed import ddp

    class Loader:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    class State:
        _shared_state = {"active": True}
        active_dataloader = None

    gathers: list[int] = []

    def all_gather_into_tensor(out, local, group=None):
        gathers.append(int(local))
        out.copy_(local.expand_as(out))

    monkeypatch.setattr(accelerate.state, "GradientState", State)
    monkeypatch.setattr(ddp.dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.setattr(ddp, "world_size", lambda group: 2)
    monkeypatch.setattr(ddp, "id", lambda obj: 1234, raising=False)  # every object at one address
    check = ddp._UnevenBatchesCheck(None, torch.device("cpu"))
    first = Loader(3)
    State.active_dataloader = first
    check()
    check()  # the same loader: compared once
    State.active_dataloader = Loader(3)  # another loader of the same length (here: at the same address)
    check()
    assert gathers == [3, 3]


def _two_ranks_answered(monkeypatch, other: dict[str, int | None]) -> tuple[type, list[int]]:  # noqa: ANN001
    """Two ranks simulated in one process for ``ddp._UnevenBatchesCheck``: accelerate's gradient state
    replaced by a class whose ``active_dataloader`` the test sets, and each all-gather answered with
    this rank's count and ``other["count"]`` (None: this rank's again). Returns the state class and
    the list of counts this rank gathered."""
    import accelerate.state

    from hf_evon.distributed import ddp

    class State:
        _shared_state = {"active": True}
        active_dataloader = None

    gathers: list[int] = []

    def all_gather_into_tensor(out, local, group=None):  # noqa: ANN001, ANN202
        gathers.append(int(local))
        out.copy_(torch.tensor([int(local), int(local) if other["count"] is None else other["count"]]))

    monkeypatch.setattr(accelerate.state, "GradientState", State)
    monkeypatch.setattr(ddp.dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.setattr(ddp, "world_size", lambda group: 2)
    return State, gathers


def test_the_uneven_batches_check_asks_each_loader_its_length_once_and_compares_a_second_loader(monkeypatch) -> None:
    """Every step asked the active loader its length before looking it up among the loaders compared
    already. Each loader is now asked once; a second train loader that appears mid-run (a resume's
    skipping loader, a subclass's own) is compared with its own length, not passed on the first's
    verdict, and is refused where the ranks' lengths differ. One process, the all-gather answered
    with this rank's count and, for the second loader, another rank's."""
    from hf_evon.distributed import ddp

    asked: list[int] = []

    class Loader:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            asked.append(self.n)
            return self.n

    other: dict[str, int | None] = {"count": None}
    State, gathers = _two_ranks_answered(monkeypatch, other)
    check = ddp._UnevenBatchesCheck(None, torch.device("cpu"))
    first = State.active_dataloader = Loader(3)
    for _ in range(4):
        check()
    assert (asked, gathers) == ([3], [3])
    second = State.active_dataloader = Loader(5)
    other["count"] = 4
    with pytest.raises(RuntimeError, match=r"different numbers of batches \(\[5, 4\], by rank"):
        check()
    assert (asked, gathers) == ([3, 5], [3, 5])
    assert first in check.checked and second not in check.checked


def test_the_uneven_batches_check_gathers_at_the_first_step_on_every_rank_whatever_its_loader(monkeypatch) -> None:
    """The Trainer takes a step's micro-batches before the step: a rank with fewer batches than
    gradient_accumulation_steps (even_batches=False) has run out, and has no active loader, at its
    first step, while another rank's loader is still active. The check gathered on the second rank
    only, so the first rank's gradient all-reduce met the second's all-gather. Every rank now
    gathers at its first step (no loader: -1) and both refuse it, naming the counts. Two ranks
    simulated in one process: each check's all-gather is counted and answered with both counts."""
    import accelerate.state

    from hf_evon.distributed import ddp

    class Loader:
        def __len__(self) -> int:
            return 2

    class State:
        _shared_state = {"active": True}
        active_dataloader = None

    gathered: dict[str, list[int]] = {"long": [], "short": []}
    rank = {"now": "long"}

    def all_gather_into_tensor(out, local, group=None):
        gathered[rank["now"]].append(int(local))
        out.copy_(torch.tensor([2, -1]))  # rank 0 (long) holds 2 batches; rank 1 (short) has run out

    monkeypatch.setattr(accelerate.state, "GradientState", State)
    monkeypatch.setattr(ddp.dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.setattr(ddp, "world_size", lambda group: 2)
    long, short = ddp._UnevenBatchesCheck(None, torch.device("cpu")), ddp._UnevenBatchesCheck(None, torch.device("cpu"))
    loader, refused = Loader(), []
    for name, check, active in (("long", long, loader), ("short", short, None)):
        rank["now"], State.active_dataloader = name, active
        try:
            check()
        except RuntimeError as error:
            refused.append(str(error))
    assert gathered == {"long": [2], "short": [-1]}
    assert len(refused) == 2 and refused[0] == refused[1]
    assert "different numbers of batches ([2, -1], by rank; -1: no active data loader at this step" in refused[0]


def test_the_uneven_batches_check_compares_a_loader_again_in_each_of_its_epochs(monkeypatch) -> None:
    """A loader was compared at its first step only: one whose length changes between epochs (a sampler
    that draws another subset each epoch) and that the ranks then hold with different lengths was never
    compared again, so a rank's extra step paired its gradient all-reduce with another rank's first step of
    the next epoch, averaging gradients of different steps, silently. Each epoch of a loader (accelerate's
    ``iteration``) is now compared at its first step, and its other steps ask nothing. One process, the
    all-gather answered with this rank's count and another rank's."""
    from hf_evon.distributed import ddp

    asked: list[int] = []

    class Loader:
        def __init__(self) -> None:
            self.n, self.iteration = 3, 0

        def __len__(self) -> int:
            asked.append(self.n)
            return self.n

    other: dict[str, int | None] = {"count": 3}
    State, gathers = _two_ranks_answered(monkeypatch, other)
    check = ddp._UnevenBatchesCheck(None, torch.device("cpu"))
    loader = State.active_dataloader = Loader()
    for _ in range(3):  # epoch 0: both ranks hold 3 batches
        check()
    assert (asked, gathers) == ([3], [3])
    loader.iteration, loader.n, other["count"] = 1, 4, 4  # epoch 1: 4 batches on both
    for _ in range(4):
        check()
    assert (asked, gathers) == ([3, 4], [3, 4])
    loader.iteration, loader.n, other["count"] = 2, 5, 4  # epoch 2: this rank 5, the other 4
    with pytest.raises(RuntimeError, match=r"different numbers of batches \(\[5, 4\], by rank"):
        check()
    assert (asked, gathers) == ([3, 4, 5], [3, 4, 5])
