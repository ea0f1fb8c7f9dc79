"""`megatron-kd <command> ...`: each command lives in its own module, imported only when used."""
import importlib
import sys

COMMANDS = {
    "demo": ("megatron_kd.cli.demo", "whole pipeline on CPU with tiny models and real text (the default job)"),
    "train": ("megatron_kd.cli.train", "distill a student from a Hydra recipe (offline / online / ce)"),
    "compare": ("megatron_kd.cli.compare", "table and loss-curve plot of finished runs (a sweep's: train -m)"),
    "cache": ("megatron_kd.cli.cache", "build, verify or inspect an offline teacher top-K cache"),
    "data": ("megatron_kd.cli.data", "tokenize text into Megatron's indexed .bin/.idx format"),
    "launch": ("megatron_kd.cli.launch", "print or run the torchrun / Slurm commands for a recipe"),
    "plan": ("megatron_kd.cli.plan", "predict per-GPU peak memory of a recipe's layout"),
    "prune": ("megatron_kd.cli.prune", "prune a Hugging Face checkpoint by depth or MLP width (a student)"),
    "export": ("megatron_kd.cli.export", "write a trained student as a Hugging Face checkpoint (needs Bridge)"),
    "loss-demo": ("megatron_kd.cli.loss_demo", "run and compare the loss impls at a small size"),
}


def usage() -> str:
    lines = ["usage: megatron-kd <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None:  # the real command line (not a call from Python): torch's cuDNN first where TE could clash
        from ..runtime.te_compat import reexec_with_torch_cudnn
        reexec_with_torch_cudnn()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatron-kd: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from ..runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()  # every command: the libraries' import-time notices are not the user's business
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
