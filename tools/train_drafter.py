"""``cgrt train-drafter``: self-distil a drafter for a model from the model's own generations.

The target (``--model``, as ``cgrt bench``'s) generates from random prompts through its own
runtime (plain greedy decoding, every committed hidden row kept); then ``--kind head``
trains an EAGLE-style draft head (``cudagraph_rt.speculative.head``) on those rows, or ``--kind
model`` a small causal LM of the target's vocabulary (``cudagraph_rt.speculative.draft_training``)
on those tokens. ``--out PATH`` gets the drafter (a head file, or a transformers checkpoint
folder for ``model``), ``--plot DIR`` the loss curve (``train_loss.png``). Prints the wall time of each phase
and the held-out acceptance estimate (greedy, k drafts). No download: the data is the
target's own. torch is imported when the command runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from cudagraph_rt.errors import expected

from . import options
from .progress import Activity

__all__ = ["add_arguments", "run"]


def _out_path(text: str) -> str:
    """``--out PATH``: a path whose folder exists."""
    folder = os.path.dirname(os.path.abspath(text))
    if not text or not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"expected a path in an existing folder, got {text!r}")
    return text


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.add_model(p, size_note="; hf models default to tiny here too")
    p.add_argument("--kind", type=options.one_of("head", "model"), default="head", metavar="K",
                   help="head: an EAGLE-style head over the target's hidden rows (default); model: a small "
                        "causal LM of the target's vocabulary (needs the hf extra)")
    p.add_argument("--steps", type=options.int_at_least(1), default=2000, metavar="N",
                   help="optimizer steps (default 2000)")
    p.add_argument("--out", type=_out_path, default=None, metavar="PATH",
                   help="where the drafter goes (required): a head file (and PATH.json), or a checkpoint folder for "
                        "--kind model")
    options.add_plot(p, "train_loss.png (the loss curve)")
    p.add_argument("--sequences", type=options.int_at_least(2), default=None, metavar="N",
                   help="generated sequences to learn from (default: 48 on a CPU, 512 on CUDA)")
    p.add_argument("--max-new", type=options.int_at_least(2), default=None, metavar="N",
                   help="tokens generated per sequence (default: to the model's max_len)")
    p.add_argument("--batch", type=options.int_at_least(1), default=None, metavar="N",
                   help="training rows per step (default: 128 on a CPU, 1024 on CUDA)")
    p.add_argument("--lr", type=_positive_float, default=1e-3, metavar="X", help="peak learning rate (default 1e-3)")
    p.add_argument("--k", type=options.int_at_least(1), default=4, metavar="N",
                   help="draft length the acceptance estimate uses (default 4)")
    p.add_argument("--hidden", type=options.int_at_least(1), default=None, metavar="N",
                   help="the head's width (default: the target's row width, at most 4096) or the draft model's "
                        "(default: a quarter of the target's, at least 64)")
    p.add_argument("--layers", type=options.int_at_least(1), default=None, metavar="N",
                   help="the head's MLP blocks (default 1) or the draft model's layers (default 2)")
    p.add_argument("--draft-vocab", type=options.int_at_least(1), default=32768, metavar="N",
                   help="head: draft from the N tokens most frequent in the generated data (default 32768; "
                        "the whole vocabulary when it is smaller)")
    options.add_graphs(p)
    options.add_device(p)
    options.add_seed(p, 0, "the model's weights, the prompts and the drafter's initialisation")
    options.add_json(p)
    options.add_threads(p)
    options.add_verbosity(p)


def _model(args, choice, device):
    from .demo import _model as build

    return build(args, choice, device)


def run(args) -> int:
    import torch

    from cudagraph_rt.speculative import training
    from cudagraph_rt.sweep.graph_modes import mode_name

    if args.out is None:
        raise options.UsageError(expected("--out", "a path for the drafter", "none"))
    choice = options.model_choice(args)
    device = options.device(args)
    if args.kind == "model":
        from cudagraph_rt.extras import available, message
        if not available("hf"):
            raise options.UsageError(expected("--kind", "head (model needs the hf extra)", message("hf", "--kind")))
    modes, notes = options.graph_modes(args.graphs, device)
    graphs = modes[0]  # the fastest mode there is: graphs on where CUDA exists
    cuda = device.type == "cuda"
    n_seq = args.sequences or (512 if cuda else 48)
    batch = args.batch or (1024 if cuda else 128)
    report: dict = {"model": choice.label, "kind": args.kind, "steps": args.steps, "device": str(device),
                    "out": args.out, "notes": notes}
    t_all = time.perf_counter()
    with options.threads(options.thread_count(args, device, choice.tiny)), Activity.of("cgrt train-drafter",
                                                                                      args) as act:
        with act.phase(f"building {choice.label} on {device.type}"):
            model = _model(args, choice, device)
        cfg = model.config
        reqs = training.random_requests(cfg, n_seq, args.seed, args.max_new)
        with act.phase(f"generating {n_seq} sequences with the target, {mode_name(graphs)}"):
            corpus = training.collect(model, reqs, graphs=graphs)
        report["generate_s"] = corpus.seconds
        report["rows"] = int(corpus.rows.shape[0])
        train, held = corpus.split(0.1)
        tick = act.counter(f"training the {args.kind}", args.steps)

        def on_step(i, loss):
            if i % 25 == 0 or i == args.steps:
                tick(i)

        if args.kind == "head":
            from cudagraph_rt.speculative.head import save_head
            target = f"{args.model} {choice.size} seed {args.seed}"
            head = training.make_head(model, train, hidden=args.hidden, layers=args.layers or 1,
                                      draft_vocab=args.draft_vocab, target=target, seed=args.seed)
            rep = training.train_head(head, model, train, steps=args.steps, batch=batch, lr=args.lr,
                                      held_out=held, k=args.k, seed=args.seed, on_step=on_step)
            save_head(head, args.out)
        else:
            from cudagraph_rt.speculative import draft_training
            rep = draft_training.train_draft_model(model, train, held, out=args.out, steps=args.steps, batch=batch,
                                                   lr=args.lr, hidden=args.hidden, layers=args.layers or 2, k=args.k,
                                                   seed=args.seed, on_step=on_step)
        if cuda:
            torch.cuda.synchronize()
    report.update({"train_s": rep.seconds, "wall_s": time.perf_counter() - t_all, "first_loss": rep.losses[0],
                   "final_loss": rep.losses[-1], "held_out_loss": rep.held_out_loss, "k": rep.k,
                   "acceptance_before": {"mean_accepted": rep.before[0], "by_position": list(rep.before[1])},
                   "acceptance_after": {"mean_accepted": rep.after[0], "by_position": list(rep.after[1])},
                   "draft_vocab_coverage": rep.coverage, "training_windows": rep.rows})
    if args.plot:
        report["plot"] = os.path.join(args.plot, "train_loss.png")
        _plot(rep.losses, report["plot"], f"cgrt train-drafter: {choice.label}, {args.kind}")
    if args.json is not None:
        options.write_json(args.json, report)
    out = sys.stderr if args.json == options.STDOUT else sys.stdout
    by = ", ".join(f"{a:.2f}" for a in rep.after[1])
    held = "" if rep.held_out_loss is None else f" (held out: {rep.held_out_loss:.3f})"
    print(f"cgrt train-drafter: {args.kind} for {choice.label} -> {args.out}\n"
          f"  generated {report['rows']} rows in {corpus.seconds:.1f} s; trained {args.steps} steps in "
          f"{rep.seconds:.1f} s; wall {report['wall_s']:.1f} s\n"
          f"  loss {rep.losses[0]:.3f} -> {rep.losses[-1]:.3f}{held}; draft vocabulary covers "
          f"{100 * rep.coverage:.1f}% of held-out next tokens\n"
          f"  acceptance estimate (held out, greedy, k={rep.k}): mean accepted {rep.before[0]:.2f} -> "
          f"{rep.after[0]:.2f} of {rep.k}; by position {by}", file=out)
    return 0


def _plot(losses, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy + row regression)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
