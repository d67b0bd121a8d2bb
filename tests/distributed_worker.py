"""Worker for tests/test_distributed.py, run on 2 CPU processes by ``accelerate launch``.

It runs every scenario in one launch (process start-up dominates the cost) and saves, per
rank, what the test needs to check the claims *independently*: the sampled weights, the
rank's own batch, gradient and noise, the optimizer state before and after a step, and the
errors raised by misuse. Usage: ``accelerate launch ... distributed_worker.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import hf_evon.optim.update as update
from hf_evon import build_optimizer, check_ranks_in_sync, prepare_distributed
from hf_evon.distributed.ddp import UnsupportedParallelismError

MICRO = 2  # micro-batches per optimizer step (accelerator.accumulate)
VOCAB, SEQ = 48, 8


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """Tiny config-built GPT-2 in float64 (so the test's comparisons can be tight)."""
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=12,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(cfg).double()


def global_batch(step: int, size: int) -> torch.Tensor:
    """The step's global batch (identical on every rank; each rank takes its own rows)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=gen)


def micro_batches(step: int, per_rank: int, rank: int) -> list[torch.Tensor]:
    rows = global_batch(step, 2 * per_rank)[rank * per_rank : (rank + 1) * per_rank]
    return list(rows.chunk(MICRO))


def evon_state(opt) -> dict[str, torch.Tensor]:
    out = {}
    for gi, g in enumerate(opt.param_groups):
        for name, p in zip(g["param_names"], g["params"]):
            for k, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"{gi}.{name}.{k}"] = v.detach().clone()
    return out


def sampled_step(accelerator, model, optimizer, evon, batches, record=None) -> None:
    """One optimizer step: one posterior sample over MICRO accumulated micro-batches."""
    with evon.sampled_params(train=True):
        for ids in batches:
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=ids, labels=ids).loss)
        if record is not None:
            record(evon)
    optimizer.step()
    optimizer.zero_grad()


def scenario_noisy(accelerator, out: dict) -> None:
    """(a) Hessian aggregate, (b) distinct noise, (c) identical ranks, accumulation, seeding."""
    rank = accelerator.process_index
    model = tiny_gpt2()
    hp = dict(
        lr=0.05,
        ess=500.0,
        hess_init=0.3,
        betas=(0.9, 0.99),
        weight_decay=1e-3,
        clip="whiten",
        hess_clip_ratio=None,
        hess_estimator="price",  # the test checks the sampled (Price) estimate, mean over ranks
        step_curvature="entry",
    )
    # a different seed per rank: prepare_distributed must hand every rank rank 0's
    optimizer = build_optimizer(model, precondition_frequency=2, adamw_lr=0.01, seed=7 + 100 * rank, **hp)
    out["seed_before"] = optimizer.seed
    model, optimizer = accelerator.prepare(model, optimizer)
    evon = prepare_distributed(model, optimizer)
    out["seed_after"] = evon.seed
    out["hparams"] = hp
    raw = accelerator.unwrap_model(model)
    evon_names = evon.param_groups[0]["param_names"]
    params = dict(raw.named_parameters())
    out["initial"] = {k: v.clone() for k, v in raw.state_dict().items()}
    steps = []
    real_check = update._moved_param  # counted: how often a step looks for moved parameters
    update._moved_param = lambda *args: out.update(moved_checks=out.get("moved_checks", 0) + 1) or real_check(*args)
    for step in range(6):
        batches = micro_batches(step, 4, rank)
        rec: dict = {"batches": batches}

        def record(opt, rec=rec) -> None:
            rec["sampled_weights"] = {k: v.clone() for k, v in raw.state_dict().items()}
            sampling = all(b.z is not None for b in opt.buckets)  # not on the initialising step
            rec["noise"] = {n: opt.current_noise(params[n]).clone() for n in evon_names} if sampling else {}
            rec["local_grad"] = {n: p.grad.clone() for n, p in params.items()}
            rec["before"] = evon_state(opt)

        sampled_step(accelerator, model, optimizer, evon, batches, record)
        rec["after"] = evon_state(evon)
        rec["mean_weights"] = {k: v.clone() for k, v in raw.state_dict().items()}
        steps.append(rec)
    update._moved_param = real_check
    out["steps"] = steps
    out["reducer_calls"] = evon.gradient_reducer.calls
    check_ranks_in_sync(model, optimizer)  # the library's own check must agree too
    out["final_weights"] = {k: v.clone() for k, v in raw.state_dict().items()}
    out["final_state"] = evon_state(evon)


def scenario_deterministic(accelerator, out: dict) -> None:
    """(d) ess=inf: 2 ranks x batch b must match one process with batch 2b."""
    rank = accelerator.process_index
    model = tiny_gpt2()
    optimizer = build_optimizer(model, **deterministic_hparams())
    model, optimizer = accelerator.prepare(model, optimizer)
    evon = prepare_distributed(model, optimizer)
    for step in range(5):
        sampled_step(accelerator, model, optimizer, evon, micro_batches(step, 4, rank))
    raw = accelerator.unwrap_model(model)
    out["det_weights"] = {k: v.clone() for k, v in raw.state_dict().items()}
    out["det_state"] = evon_state(evon)


def deterministic_hparams() -> dict:
    return dict(
        lr=0.02,
        ess=float("inf"),
        hess_init=0.1,
        betas=(0.9, 0.999),
        weight_decay=1e-4,
        hess_clip_ratio=None,
        clip="none",
        precondition_frequency=2,
        adamw_lr=0.01,
    )


def expect_error(out: dict, key: str, fn) -> None:
    try:
        fn()
    except Exception as err:  # recorded and checked by the test
        out[key] = f"{type(err).__name__}: {err}"
    else:
        out[key] = None


def scenario_misuse(accelerator, out: dict) -> None:
    """(e) forgetting prepare_distributed, preparing the wrong module, mismatched ranks."""
    rank = accelerator.process_index

    def forgot_prepare() -> None:
        raw = tiny_gpt2()
        opt = build_optimizer(raw, ess=100.0)
        model, optimizer = accelerator.prepare(raw, opt)
        sampled_step(accelerator, model, optimizer, optimizer.optimizer, micro_batches(0, 4, rank))

    def unwrapped_module() -> None:
        raw = tiny_gpt2()
        opt = build_optimizer(raw, ess=100.0)
        model, optimizer = accelerator.prepare(raw, opt)
        evon = prepare_distributed(accelerator.unwrap_model(model), optimizer)  # wrong: DDP still averages
        for step in range(3):
            sampled_step(accelerator, model, optimizer, evon, micro_batches(step, 4, rank))

    def mismatched() -> None:
        raw = tiny_gpt2()
        model, optimizer = accelerator.prepare(raw, build_optimizer(raw, ess=100.0))
        evon = prepare_distributed(model, optimizer)
        with evon.sampled_params(train=True):
            for ids in micro_batches(0, 4, rank):
                with accelerator.accumulate(model):
                    accelerator.backward(model(input_ids=ids, labels=ids).loss)
        if rank == 1:
            raw.transformer.ln_f.bias.grad = None  # this rank "did not use" a parameter
        optimizer.step()

    def sample_failed_on_one_rank() -> None:
        raw = tiny_gpt2()
        model, optimizer = accelerator.prepare(raw, build_optimizer(raw, ess=100.0))
        evon = prepare_distributed(model, optimizer)
        sampled_step(accelerator, model, optimizer, evon, micro_batches(0, 4, rank))  # initialising step
        for i in range(2):  # rank 1's second block raises and is caught: one sample fewer there
            try:
                with evon.sampled_params(train=True):
                    for ids in micro_batches(1, 4, rank):
                        with accelerator.accumulate(model):
                            accelerator.backward(model(input_ids=ids, labels=ids).loss)
                    if rank == 1 and i == 1:
                        raise ValueError("a failed logging callback")
            except ValueError:
                pass
        try:
            optimizer.step()
        finally:
            optimizer.zero_grad()
            out["samples_after_refusal"] = evon.recorded_samples
            for step in (2, 3):  # still usable, and the ranks stay in step
                sampled_step(accelerator, model, optimizer, evon, micro_batches(step, 4, rank))
            check_ranks_in_sync(model, optimizer)

    def recast_after_synchronize() -> None:
        raw = tiny_gpt2()
        model, optimizer = accelerator.prepare(raw, build_optimizer(raw, ess=100.0))
        evon = prepare_distributed(model, optimizer)
        sampled_step(accelerator, model, optimizer, evon, micro_batches(0, 4, rank))  # the AdamW state made
        with evon.sampled_params(train=True):
            for ids in micro_batches(1, 4, rank):
                with accelerator.accumulate(model):
                    accelerator.backward(model(input_ids=ids, labels=ids).loss)
        evon.synchronize()  # as the Trainer does to clip: the averaging checked every parameter already
        bias = raw.transformer.ln_f.bias
        before = {k: v.clone() for k, v in raw.state_dict().items()}
        bias.data = bias.data.float()  # after that check, before the step
        try:
            optimizer.step()
        finally:
            optimizer.zero_grad()
            out["recast_kept"] = all(torch.equal(v, before[k].to(v.dtype)) for k, v in raw.state_dict().items())

    def early_synchronize_checks() -> None:
        raw = tiny_gpt2()
        model, optimizer = accelerator.prepare(raw, build_optimizer(raw, ess=100.0))
        evon = prepare_distributed(model, optimizer)
        for step in range(2):  # the initialising step, then a noisy one: the averaged tensors settle
            sampled_step(accelerator, model, optimizer, evon, micro_batches(step, 4, rank))
        real_check, checks = update._moved_param, []
        update._moved_param = lambda *args: checks.append(1) or real_check(*args)
        try:
            for step in (2, 3):
                with evon.sampled_params(train=True):
                    for ids in micro_batches(step, 4, rank):
                        with accelerator.accumulate(model):
                            accelerator.backward(model(input_ids=ids, labels=ids).loss)
                evon.synchronize()  # as the Trainer does to clip, before its step
                optimizer.step()
                optimizer.zero_grad()
        finally:
            update._moved_param = real_check
        out["early_synchronize_moved_checks"] = len(checks)

    def different_hyperparameters() -> None:
        raw = tiny_gpt2()
        opt = build_optimizer(raw, ess=100.0, learning_rate=1e-3 if rank == 0 else 2e-3)
        model, optimizer = accelerator.prepare(raw, opt)
        evon = prepare_distributed(model, optimizer)
        sampled_step(accelerator, model, optimizer, evon, micro_batches(0, 4, rank))

    expect_error(out, "error_samples", sample_failed_on_one_rank)
    expect_error(out, "error_hyperparameters", different_hyperparameters)
    expect_error(out, "error_recast", recast_after_synchronize)
    early_synchronize_checks()
    expect_error(out, "error_forgot", forgot_prepare)
    expect_error(out, "error_unwrapped", unwrapped_module)
    expect_error(out, "error_mismatch", mismatched)


def scenario_fsdp(accelerator, out: dict) -> None:
    """(f) FSDP1, and FSDP2 without EVON's sharded mode, must be refused with a clear error."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    def fsdp1() -> None:
        model = FullyShardedDataParallel(tiny_gpt2().float(), device_id=torch.device("cpu"))
        prepare_distributed(model, build_optimizer(model, ess=100.0))

    def fsdp2() -> None:  # supported in EVON's sharded mode only (tests/test_fsdp2.py)
        model = tiny_gpt2().float()
        fully_shard(model)
        prepare_distributed(model, build_optimizer(model, ess=100.0), shard=False)

    expect_error(out, "error_fsdp1", fsdp1)
    expect_error(out, "error_fsdp2", fsdp2)
    out["unsupported_error_name"] = UnsupportedParallelismError.__name__


def scenario_uneven_join(accelerator, out: dict) -> None:
    """(g) DDP's join with uneven inputs (``model.join()``; accelerate's ``join_uneven_inputs`` is a
    no-op on CPUs): rank 1 runs out of batches first. A joined rank shadows only DDP's collectives,
    not EVON's step, so EVON must refuse on every rank, not hang."""
    rank = accelerator.process_index

    def uneven(shard: bool) -> None:
        raw = tiny_gpt2()
        model, optimizer = accelerator.prepare(raw, build_optimizer(raw, ess=100.0))
        evon = prepare_distributed(model, optimizer, shard=shard)
        with model.join():
            for step in range(3 if rank == 0 else 2):
                sampled_step(accelerator, model, optimizer, evon, micro_batches(step, 4, rank))

    expect_error(out, "error_join", lambda: uneven(False))
    expect_error(out, "error_join_sharded", lambda: uneven(True))


def scenario_uneven_batches(accelerator, out: dict) -> None:
    """(h) ``even_batches=False`` with 5 batches over 2 ranks: rank 0 gets 3, rank 1 two. Rank 0's
    third step waits in EVON's collectives for a rank that has left the loop: every rank must
    refuse the first step instead, naming the setting, with the weights untouched. (Not at the
    short rank's last batch: there accelerate's accumulate syncs early on that rank alone, and
    DDP's forward then waits for the other rank before EVON runs.)"""
    rows = torch.stack([global_batch(step, 1)[0] for step in range(10)])

    def uneven(shard: bool) -> None:
        raw = tiny_gpt2()
        start = {n: p.detach().clone() for n, p in raw.named_parameters()}
        accelerator.even_batches = False
        try:
            loader = accelerator.prepare(torch.utils.data.DataLoader(rows, batch_size=2))
        finally:
            accelerator.even_batches = True
        model, optimizer = accelerator.prepare(raw, build_optimizer(raw, ess=100.0))
        evon = prepare_distributed(model, optimizer, shard=shard)
        try:
            for ids in loader:
                sampled_step(accelerator, model, optimizer, evon, [ids] * MICRO)
        finally:
            out[f"uneven_batches_untouched_{shard}"] = all(
                torch.equal(p, start[n]) for n, p in accelerator.unwrap_model(model).named_parameters()
            )

    expect_error(out, "error_uneven_batches", lambda: uneven(False))
    expect_error(out, "error_uneven_batches_sharded", lambda: uneven(True))


def scenario_unused_group(accelerator, out: dict) -> None:
    """(i) A group whose weight never gets a gradient (a frozen extra layer in its own group): the
    pooled reductions of the curvature fits (``pool_rows``: collectives) per rank over 6 steps at
    ``curvature_refit=3``, with that group and without it, and the weights after them."""
    for extra in (False, True):
        raw = tiny_gpt2()
        raw.extra = torch.nn.Linear(12, 12, bias=False).double().requires_grad_(False)
        optimizer = build_optimizer(raw, ess="auto", curvature_refit=3)
        if extra:
            optimizer.add_param_group({"params": [raw.extra.weight], "param_names": ["extra.weight"]})
        model, optimizer = accelerator.prepare(raw, optimizer)
        evon = prepare_distributed(model, optimizer)
        calls = []
        pool_rows = evon._hooks.pool_rows
        evon._hooks.pool_rows = lambda *a, calls=calls, pool_rows=pool_rows, **k: calls.append(1) or pool_rows(*a, **k)
        for step in range(6):
            sampled_step(accelerator, model, optimizer, evon, micro_batches(step, 4, accelerator.process_index))
        out[f"unused_group_pools_{extra}"] = len(calls)
        out[f"unused_group_weights_{extra}"] = {k: v.clone() for k, v in raw.state_dict().items()}


def main() -> None:
    out_dir = sys.argv[1]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    assert accelerator.num_processes == 2, accelerator.num_processes
    out: dict = {"world_size": dist.get_world_size(), "rank": accelerator.process_index}
    scenario_noisy(accelerator, out)
    scenario_deterministic(accelerator, out)
    scenario_misuse(accelerator, out)
    scenario_fsdp(accelerator, out)
    scenario_uneven_join(accelerator, out)
    scenario_unused_group(accelerator, out)
    scenario_uneven_batches(accelerator, out)  # last: it leaves its loaders half-iterated
    torch.save(out, os.path.join(out_dir, f"rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group on every rank together


if __name__ == "__main__":
    main()
    from launcher import finish

    finish()
