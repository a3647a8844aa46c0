"""Run by tests/test_trainer.py under `torchrun --nproc_per_node 2 -m tests.ddp_worker` from the repository root
(CPU: gloo): trains, then every rank writes a checksum of its LoRA weights so the test can check that gradient
averaging kept the ranks identical."""

import hashlib
import json
import sys
from pathlib import Path

import moss_image_train_network as m


def main() -> None:
    args = m.setup_parser().parse_args(sys.argv[1:])
    run = m.MossImageNetworkTrainer().train(args)
    digest = hashlib.sha256()
    for k, v in sorted(run.network.state_dict().items()):
        digest.update(k.encode())
        digest.update(v.detach().float().cpu().numpy().tobytes())
    acc = run.accelerator
    report = {"rank": acc.process_index, "world": acc.num_processes, "steps": run.global_step,
              "batches": len(run.train_dataloader), "sha": digest.hexdigest()}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
