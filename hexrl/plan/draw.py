"""A picture of the plan: one row per node, one box per GPU, coloured by role (matplotlib)."""

import sys

from hexrl.schema import Plan


def pyplot(what: str, path: str):
    """matplotlib.pyplot on the file-only backend, or None (saying so on stderr) when not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{what}: matplotlib is not installed, so nothing was written to {path} "
              "(pip install matplotlib, or `pip install -e .[plot]`)", file=sys.stderr)
        return None
    return plt


LEGEND = ("T sS dD tT: trainer, pipeline stage S, data-parallel rank D, tensor-parallel rank T;  "
          "RN tT: rollout replica N, its tensor-parallel rank T")


def box_label(rank) -> str:
    """A GPU's two-line label in the picture (abbreviations: LEGEND, printed under it)."""
    if rank.role == "train":
        return f"T s{rank.pp}\nd{rank.dp} t{rank.tp}"
    return f"R{rank.replica}\nt{rank.tp}"


def draw_plan(plan: Plan, path: str) -> bool:
    """Write a PNG of the assignment; False (with a message on stderr) if matplotlib is missing."""
    plt = pyplot("--draw", path)
    if plt is None:
        return False
    c = plan.job.cluster
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * c.gpus_per_node, 0.6 + 0.6 * len(c.nodes)))
    train_cm, roll_cm = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
    pp = max(1, plan.trainer.pp)
    n_rep = max(1, len(plan.replicas))
    for x in plan.ranks:
        y = len(c.nodes) - 1 - x.node
        if x.role == "train":
            color = train_cm(0.35 + 0.55 * x.pp / pp)
        else:
            color = roll_cm(0.3 + 0.6 * (x.replica % 8) / min(8, n_rep))
        label = box_label(x)
        ax.add_patch(plt.Rectangle((x.local_rank, y), 0.92, 0.85, color=color))
        ax.text(x.local_rank + 0.46, y + 0.42, label, ha="center", va="center", fontsize=7)
    ax.set_yticks([len(c.nodes) - 1 - i + 0.42 for i in range(len(c.nodes))])
    ax.set_yticklabels([f"{n.name} ({n.gpu_type})" for n in c.nodes], fontsize=8)
    ax.set_xlim(0, c.gpus_per_node)
    ax.set_ylim(0, len(c.nodes))
    ax.set_xticks([])
    pr = plan.predicted
    ax.set_title(f"step {pr.get('step_time_s', 0):.1f} s, {pr.get('tokens_per_s', 0):.0f} tokens/s, "
                 f"${pr.get('cost_per_hour', 0):.2f}/h  (blue: train stages, orange: rollout replicas)",
                 fontsize=8)
    fig.text(0.5, 0.01, LEGEND, ha="center", va="bottom", fontsize=6)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


GANTT_COLORS = {"train": "tab:blue", "sync": "tab:red", "decode": "tab:orange", "prefill": "tab:green",
                "recompute": "tab:purple", "reward": "tab:brown", "host": "tab:gray"}


def draw_gantt(gantt: list, path: str, title: str = "") -> bool:
    """Write a Gantt chart of (lane, kind, t0, t1) intervals; False if matplotlib is missing."""
    plt = pyplot("--gantt", path)
    if plt is None:
        return False
    lanes = list(dict.fromkeys(lane for lane, *_ in gantt))
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.28 * len(lanes)))
    for lane, kind, t0, t1 in gantt:
        y = len(lanes) - 1 - lanes.index(lane)
        ax.barh(y, t1 - t0, left=t0, height=0.8, color=GANTT_COLORS.get(kind, "grey"), linewidth=0)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(reversed(lanes), fontsize=7)
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in GANTT_COLORS.values()]
    ax.legend(handles, GANTT_COLORS, fontsize=7, loc="upper right", ncol=5)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
