"""DeepSpeed + flashqla GDN sequence parallelism on gloo (CPU): an HF Qwen3-Next model (tiny, from
config, MoE included) trained on packed documents with Ulysses SP for its softmax attention and
flashqla's state-passing CP for its GDN layers equals the single-process run: the loss, every
parameter gradient, the parameters after several clipped SGD steps, under ZeRO 1, 2 and 3 (and
with activation checkpointing); the parameters are identical on every rank; a checkpoint resumes
with the same losses; the routes that would give wrong gradients raise. One process group per SP size runs every check (starting ranks costs the most).
"""
import gc
import os

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
from multiprocess import run_on_ranks  # noqa: E402

STEPS = 3
TOKENS = 48  # one packed row per step; divisible by every SP size tested
LR, CLIP = 2.0, 0.05  # the clip threshold is below the gradient norm, so clipping acts
# SGD with momentum: parameter differences stay proportional to gradient differences (Adam's normalised
# steps would blow fp32 noise in near-zero gradients up to full-size updates)


def tiny_config():
    from transformers import Qwen3NextConfig
    from flashqla.deepspeed import register_varlen_sdpa

    return Qwen3NextConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        decoder_sparse_step=2, use_cache=False, attn_implementation=register_varlen_sdpa())


def build_model():
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    return Qwen3NextForCausalLM(tiny_config())


def packed_batch(step):
    """One row of documents of random lengths: input ids, position ids restarting per document, and
    labels shifted within each document (-100 on each document's last token)."""
    gen = torch.Generator().manual_seed(100 + step)
    cuts = sorted(torch.randperm(TOKENS - 1, generator=gen)[:3].add(1).tolist())
    bounds = [0] + cuts + [TOKENS]
    ids = torch.randint(0, 61, (1, TOKENS), generator=gen)
    position_ids = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    labels = torch.full_like(ids, -100)
    for s, e in zip(bounds[:-1], bounds[1:]):
        labels[0, s:e - 1] = ids[0, s + 1:e]
    return ids, position_ids, labels


def reference_run():
    """Single process, whole rows: per-step losses, the first step's gradients, the final parameters."""
    from flashqla.deepspeed import causal_lm_loss
    from flashqla.hf import use_flashqla_gdn

    model = build_model()
    use_flashqla_gdn(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, first_grads = [], None
    for step in range(STEPS):
        ids, position_ids, labels = packed_batch(step)
        loss, _ = causal_lm_loss(model(input_ids=ids, position_ids=position_ids).logits, labels)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def ds_config(stage):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6}


# dA_log and ddt_bias sum every token and head with heavy cancellation: in fp32 the single-process
# gradients themselves sit up to 2.2e-3 (relative L2) from a float64 run, so they get a wider bar
GRAD_TOLERANCE = {"A_log": 5e-3, "dt_bias": 5e-3}


def grad_tolerance(name):
    return GRAD_TOLERANCE.get(name.rsplit(".", 1)[-1], 2e-5)


def rel_err(ref, out):
    return ((ref - out).norm() / (ref.norm() + 1e-12)).item()


def sp_engine(stage, mpu, checkpointing=False):
    import flashqla.deepspeed as fds

    model = build_model()
    fds.enable_gdn_sequence_parallel(model, mpu)  # swaps the GDN layers: before the optimizer takes the parameters
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, *_ = fds.initialize(model=model, config=ds_config(stage), mpu=mpu, optimizer=optimizer)
    return engine


def sp_step(engine, step, group, on_grads=None):
    """One training step on this rank's shard; returns the mean loss over the whole row."""
    import torch.distributed as dist
    from flashqla.deepspeed import causal_lm_loss

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shard = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    ids, position_ids, labels = (t[:, shard] for t in packed_batch(step))
    loss, mean = causal_lm_loss(engine(input_ids=ids, position_ids=position_ids).logits, labels, group)
    engine.backward(loss)
    if on_grads is not None:
        on_grads(engine)
    engine.step()
    return mean.item()


def full_params(engine):
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def assert_identical_on_every_rank(params, where):
    import torch.distributed as dist

    flat = torch.cat([p.reshape(-1) for p in params.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for other, theirs in enumerate(gathered):
        assert torch.equal(theirs, flat), f"{where}: parameters of rank {other} differ from rank {dist.get_rank()}'s"


def _sp_suite(rank, world, checkpoint_dir):
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank))  # what a launcher would set
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import safe_get_full_grad
    from flashqla.deepspeed import skip_cpu_shm_build

    skip_cpu_shm_build()
    deepspeed.init_distributed("gloo")

    ref_losses, ref_grads, ref_params = reference_run()  # before Ulysses wraps the attention function
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        build_model(), tiny_config()._attn_implementation, world, micro_batch_size=1)
    group = mpu.get_sequence_parallel_group()

    for stage, checkpointing in ((1, False), (2, False), (3, False), (3, True)):
        where = f"SP {world}, ZeRO-{stage}{' + activation checkpointing' if checkpointing else ''}"
        engine = sp_engine(stage, mpu, checkpointing)
        grads = {}

        def keep_grads(engine):
            grads.update({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})

        losses = [sp_step(engine, step, group, keep_grads if step == 0 else None) for step in range(STEPS)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=2e-6,
                                   msg=f"{where}: losses")
        assert grads.keys() == ref_grads.keys()
        bad = {n: e for n in ref_grads if (e := rel_err(ref_grads[n], grads[n])) > grad_tolerance(n)}
        assert not bad, f"{where}: first-step gradients differ from SP = 1 (relative L2): {bad}"
        params = full_params(engine)
        bad = {n: e for n in ref_params if (e := rel_err(ref_params[n], params[n])) > 2e-5}
        assert not bad, f"{where}: parameters after {STEPS} clipped SGD steps differ from SP = 1: {bad}"
        assert_identical_on_every_rank(params, where)
        # torn down here (destroy, drop, collect), not wherever the garbage collector would run its
        # __del__: ZeRO-3's teardown removes hooks and clears DeepSpeed's global debug names, which left
        # to chance lands in the middle of the next engine's step
        engine.destroy()
        del engine
        gc.collect()

    check_refusals(world, mpu, group)

    # checkpoint after step 2, then step 3 from a fresh engine that loads it: the same loss and parameters
    engine = sp_engine(2, mpu)
    for step in range(STEPS - 1):
        sp_step(engine, step, group)
    engine.save_checkpoint(checkpoint_dir, tag="resume")
    last_loss, last_params = sp_step(engine, STEPS - 1, group), full_params(engine)
    resumed = sp_engine(2, mpu)
    resumed.load_checkpoint(checkpoint_dir, tag="resume")
    assert sp_step(resumed, STEPS - 1, group) == last_loss, "resumed run: a different loss"
    for name, value in full_params(resumed).items():
        assert torch.equal(value, last_params[name]), f"resumed run: parameter {name} differs"
    engine.destroy()
    resumed.destroy()
    del engine, resumed
    gc.collect()


def check_refusals(world, mpu, group):
    """The wrong routes raise a clear error instead of training on wrong gradients."""
    import flashqla.deepspeed as fds
    from flashqla.layers import GatedDeltaNet

    model = build_model()
    with pytest.raises(ValueError, match="sequence_parallel_size"):  # DeepSpeed's config-mesh SP route
        fds.initialize(model=model, config={**ds_config(1), "sequence_parallel_size": world})
    stage3 = ds_config(3)
    stage3["zero_optimization"]["reduce_scatter"] = True
    with pytest.raises(ValueError, match="reduce_scatter"):
        fds.initialize(model=model, config=stage3, mpu=mpu)

    class ForeignGatedDeltaNet(torch.nn.Module):  # e.g. FLA's or HF's layer, not on flashqla's CP path
        pass

    model.model.layers[0].linear_attn = ForeignGatedDeltaNet()
    with pytest.raises(ValueError, match="not flashqla's"):
        fds.enable_gdn_sequence_parallel(model, mpu)
    layer = torch.nn.Sequential(GatedDeltaNet(32, 2, 4, 16, 16))
    fds.enable_gdn_sequence_parallel(layer, group)  # a plain torch.distributed group works too
    with pytest.raises(ValueError, match="without cp_context"):
        layer[0](torch.randn(1, TOKENS // world, 32))

    # a dense model (no MoE block to mark as a ZeRO-3 leaf; DeepSpeed refuses absent leaf classes)
    from transformers import Qwen3NextForCausalLM

    dense_config = tiny_config()
    dense_config.num_experts = 0
    dense = Qwen3NextForCausalLM(dense_config)
    fds.enable_gdn_sequence_parallel(dense, mpu)
    engine, *_ = fds.initialize(model=dense, config=ds_config(3), mpu=mpu,
                                optimizer=torch.optim.SGD(dense.parameters(), lr=LR))
    engine.destroy()
    del engine, dense
    gc.collect()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_sp_equals_single_process_in_loss_gradients_and_steps_under_zero_1_2_3(world, tmp_path):
    run_on_ranks(world, _sp_suite, str(tmp_path))
