"""Calibration of the catalogue against the AReaL-Hex paper's measurements.

    python -m hexrl.plan.paper_calibration      # the fit, and every ratio against the paper

Table 1 of the paper gives, per model and GPU type, the $ per generated token and the $ per
trained token; both are at one GPU's price, so their quotient is how many times faster one GPU
trains a token than it generates one. The datasheet cost model generates 2-5x too fast against
that (no framework overhead, no sampling, no scheduler gaps), so every decode/prefill
efficiency of a type is scaled by one factor f, the geometric mean over the three models of
paper ratio / model ratio. The factors land in hexrl/gpus.py as catalogue fields
(hbm_efficiency, decode_mfu, prefill_mfu, decode_overhead_s), the same fields a measured
profile (profiles/<gpu>.json) sets and overrides: one code path.
"""

import math

from hexrl.gpus import PAPER_DECODE_FACTOR, gpu
from hexrl.schema import load_job

# (model preset, GPU) -> ($ per inference token, $ per training token); AReaL-Hex Table 1, rows as named
TABLE1 = {
    ("r1-distill-qwen-1.5b", "H800"): (5.58e-3, 1.66e-3),  # Table 1, row "1.5B H800"
    ("r1-distill-qwen-1.5b", "H20"): (2.06e-3, 5.16e-3),  # Table 1, row "1.5B H20"
    ("r1-distill-qwen-7b", "H800"): (1.14e-2, 3.05e-3),  # Table 1, row "7B H800"
    ("r1-distill-qwen-7b", "H20"): (4.15e-3, 9.51e-3),  # Table 1, row "7B H20"
    ("r1-distill-qwen-14b", "H800"): (3.43e-2, 0.99e-2),  # Table 1, row "14B H800"
    ("r1-distill-qwen-14b", "H20"): (1.27e-2, 3.10e-2),  # Table 1, row "14B H20"
}


def paper_job(preset: str, gpu_type: str) -> dict:
    """One 8-GPU node of `gpu_type` running the paper's workload (tools/configs/paper_*.json)."""
    return {
        "model": {"preset": preset}, "data": {"synthetic": {}},
        "rl": {"batch_size": 512, "group_size": 16, "eta": 4, "ppo_minibatches": 4, "max_new_tokens": 8192},
        "workload": {"prompt_len": 256, "output_len": {"mean": 5000, "max": 8192}},
        "cluster": {"nodes": [{"name": "n0", "gpu_type": gpu_type, "gpus": 8}]},
    }


def paper_ratio(preset: str, gpu_type: str) -> float:
    """Generation speed / training speed per GPU, from Table 1: $/trained token over $/generated
    token at the same GPU price."""
    inf, train = TABLE1[(preset, gpu_type)]
    return train / inf


def model_ratio(preset: str, gpu_type: str, calibrated: bool = True) -> float:
    """The cost model's generated tokens/s per GPU over its trained tokens/s per GPU (one node)."""
    from hexrl.plan.cost import CostModel
    from hexrl.plan.train_search import search_train

    cm = CostModel(load_job(paper_job(preset, gpu_type)), use_profiles=False)
    if not calibrated:
        cm.gpus[gpu_type] = gpu(gpu_type, use_profiles=False, calibrated=False)
    gen = max(pt.tokens_per_s / tp for tp in cm.tp_options(gpu_type) for pt in cm.decode_points(gpu_type, tp, False))
    train = cm.w.tokens / search_train(cm, (8,)).time_s / 8
    return gen / train


def fit(gpu_type: str) -> float:
    """The decode/prefill efficiency factor f for a type with Table 1 rows."""
    presets = [p for p, t in TABLE1 if t == gpu_type]
    return math.exp(sum(math.log(paper_ratio(p, gpu_type) / model_ratio(p, gpu_type, False)) for p in presets)
                    / len(presets))


def main():
    for t in sorted({t for _, t in TABLE1}):
        print(f"{t}: fitted factor {fit(t):.3f} (in hexrl/gpus.py PAPER_DECODE_FACTOR: {PAPER_DECODE_FACTOR[t]:.3f})")
        for p in [p for p, k in TABLE1 if k == t]:
            paper = paper_ratio(p, t)
            print(f"  {p:<22} generate/train speed: paper {paper:.3f}, datasheet model "
                  f"{model_ratio(p, t, False):.3f}, calibrated {model_ratio(p, t):.3f}")


if __name__ == "__main__":
    main()
