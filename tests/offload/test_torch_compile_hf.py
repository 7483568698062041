"""Compiled training with vmalloc's plan for Hugging Face models: a tiny GPT-2 and a tiny BERT
built from their configs (no download), given an attention mask, whose mask code branches on
the mask's values (``attention_mask.all()``). vmalloc.torch.policy records them on FakeTensors
(the mask code takes its tracing path, as under torch.compile); before, it recorded on plain
meta tensors and refused both (InvalidArgumentError: meta tensors have no values). The
compiled graphs hold the plan's offloads; losses and weights are bit-identical to compiled
in-core training (offload on CPU is a CPU-to-CPU copy)"""

import importlib.util
import pathlib
import time
import warnings

import pytest

torch = pytest.importorskip("torch", reason="vmalloc.torch.policy needs PyTorch")
transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs "
                                   "transformers")

import vmalloc.torch as vtorch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name, path):
    # examples and test helpers are no package (pytest's importlib mode: not on sys.path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


graphs_of = _load("_compile_graphs", ROOT / "tests" / "offload" / "_compile_graphs.py")
capturing = _load("_torch_compile_example",
                  ROOT / "examples" / "torch_compile_out_of_core.py").capturing
BATCH, SEQ, VOCAB = 8, 16, 100


def gpt2(dropout=0.0):
    torch.manual_seed(0)
    # Dropout off so that every op of the region has its decision: recorded, dropout is its
    # eager decomposition (bernoulli_, mul); compiled, aten.native_dropout (unmatched: saved).
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                     n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def bert():
    torch.manual_seed(0)         # dropout off, as GPT-2's
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=VOCAB,
                                     max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def loss_fn(out, ids):
    """Cross entropy against the inputs, outside the model: passing ``labels`` runs
    transformers' loss, whose logger call breaks torch.compile's graph inside the region."""
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())


def batch(padded=False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -3:] = 0            # the first sequence is 3 tokens shorter
    return {"input_ids": ids, "attention_mask": mask}, ids


def run(model, inputs, ids, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = loss_fn(model(**inputs), ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
    return losses, seconds


# (model, padded mask, (save, recompute, offload) planned, unmatched, offload refused: the
# layer norms, offloads in the forward graph)
MODELS = {"gpt2": (gpt2, False, (59, 0, 18), 3, 3, 7),
          "bert": (bert, True, (59, 0, 12), 2, 2, 6)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_masked_model_compiles_with_the_plans_offloads(name):
    build, padded, planned, unmatched, refused, puts = MODELS[name]
    model, reference = build(), build()
    inputs, ids = batch(padded)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # weights, gradients and momentum, and no room left for activations: the plan offloads
    plan = vtorch.policy(model, (inputs, ids), loss_fn=loss_fn, budget=3 * params,
                         link_gbps=12)
    assert plan.plan.feasible and plan.mapped
    stats = plan.stats()
    assert (stats["save"], stats["recompute"], stats["offload"]) == planned
    graphs = {}
    compiled = vtorch.compile_out_of_core(model, plan, backend=capturing(graphs))
    # Recorded on meta, attention is the math path; on CPU it is one flash-attention op per
    # layer, which has no decision (said once, saved); GPT-2's third: one aten.clone more.
    with pytest.warns(UserWarning, match="_scaled_dot_product_flash_attention_for_cpu"):
        losses, seconds = run(compiled, inputs, ids)
    in_core, _ = run(torch.compile(reference, backend="aot_eager"), inputs, ids)
    print(f"{name} (2 layers, width 64): first compiled step {seconds[0]:.2f} s")
    assert losses == in_core
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    stats = plan.stats()
    assert (stats["unmatched_ops"], stats["offload_refused"]) == (unmatched, refused)
    assert stats["offloads_run_eagerly"] == 0            # one graph: no break in the region
    offloaded = {k for k, v in plan.decisions.items() if v == "offload"}
    got = graphs_of.offloaded_keys(graphs["forward"])
    assert len(got) == len(set(got)) == puts and set(got) <= offloaded
    forward, backward = (graphs_of.device_puts(graphs[k]) for k in ("forward", "backward"))
    assert sorted(p.name for p in backward) == sorted(
        p.name.replace("cpu_offload_", "gpu_reload_") for p in forward)


def test_gpt2_policy_leaves_the_model_untouched():
    """Recording trains a FakeTensor copy: the model's weights and their storage stay."""
    model = gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, ids = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # nothing to say for this model
        vtorch.policy(model, (inputs, ids), loss_fn=loss_fn, budget="1GiB", link_gbps=12)
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and type(p) is torch.nn.Parameter
        assert torch.equal(p, before[n]) and p.grad is None
    assert model.lm_head.weight is model.transformer.wte.weight      # still tied


def test_keyword_and_positional_examples_plan_alike():
    """``(kwargs, target)`` reaches the model as keywords, through a wrapper that runs no op:
    the same plan as the positional call ``model(input_ids, None, attention_mask)``. The
    positional call is the one refused before (on meta: Tensor.item() in the mask code)."""
    model = gpt2()
    inputs, ids = batch()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    by_position = vtorch.policy(model, ((ids, None, inputs["attention_mask"]), ids),
                                loss_fn=loss_fn, budget=3 * params, link_gbps=12)
    by_name = vtorch.policy(model, (inputs, ids), loss_fn=loss_fn, budget=3 * params,
                            link_gbps=12)
    assert by_position.mapped and by_position.decisions == by_name.decisions
    assert len(by_name.decisions) == 77


def test_a_model_in_eval_mode_is_planned_as_it_trains():
    """from_pretrained returns a model in eval mode. The iteration is recorded in train mode
    (dropout runs); the forward's keys were taken in the model's own mode, so with dropout the
    two differed and nothing was mapped (said, all saved). Now both are in train mode, and
    the model keeps its mode."""
    model = gpt2(dropout=0.1).eval()
    inputs, ids = batch()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # "nothing is mapped" is not said
        in_eval = vtorch.policy(model, (inputs, ids), loss_fn=loss_fn, budget=3 * params,
                                link_gbps=12)
    assert not model.training and in_eval.mapped
    in_train = vtorch.policy(model.train(), (inputs, ids), loss_fn=loss_fn,
                             budget=3 * params, link_gbps=12)
    assert in_eval.decisions == in_train.decisions
    assert ("aten.bernoulli_.float", 0) in in_eval.decisions     # dropout's, recorded
