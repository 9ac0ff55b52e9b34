"""Train your own task from Python: the same processes and guarantees as `flotilla run`."""

import sys
from pathlib import Path

from safetensors.torch import load_file
from task import Spirals

import flotilla

if __name__ == "__main__":  # every worker imports task.py, never runs this block
    strategy = sys.argv[1] if len(sys.argv) > 1 else "allreduce"  # or ps, pipeline
    cfg = flotilla.make_config(Path(__file__).parent / f"{strategy}.yaml")
    task = Spirals(width=64, depth=3, num_samples=6000)
    summary = flotilla.run(cfg, task=task, report_dir=f"runs/own_{strategy}_py")
    print(f"test accuracy {summary['test_accuracy']:.4f}; model: {summary['model_file']}")
    model = task.build_model()
    model.load_state_dict(load_file(summary["model_file"]))  # your model, trained
