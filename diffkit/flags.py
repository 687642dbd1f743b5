"""The flags of `diffkit diff`, declared once: the `diff` command takes them all, and `diffkit suite` passes the
ones it shares (its PASS_THROUGH) on to each pair's diff.  (Layer 11, beside the suite that reads them; the CLI
above both applies them to its `diff` command.)"""
from __future__ import annotations

import click

from .options import FOLD_AFTER, Options

DEFAULT_TIMEOUT = 1800.0  # seconds per side; a kernel that never returns must not hold a CI job forever

# in the order `diffkit diff --help` lists them
DIFF_OPTIONS: list[click.Option] = [
    click.Option(["--atol"], type=float, default=None,
                 help="absolute tolerance (default by dtype: 1e-4 fp32, 1e-2 fp16/bf16)"),
    click.Option(["--rtol"], type=float, default=None, help="relative tolerance (default as --atol)"),
    click.Option(["--seed"], type=int, default=Options.seed, show_default=True,
                 help="KernelBench's seed: each trial's input seed is drawn from it (models are always built with 42)"),
    click.Option(["--trials"], type=click.IntRange(min=1), default=Options.trials, show_default=True,
                 help="KernelBench trials, each on fresh inputs: the first diffed stage by stage, later ones by their "
                      "outputs, the first failing one then diffed in full"),
    click.Option(["--eval", "eval_mode"], is_flag=True,
                 help="put both models in eval() (default: as constructed, as KernelBench runs them: BatchNorm uses "
                      "batch statistics, dropout is live)"),
    click.Option(["--sync-weights"], is_flag=True,
                 help="copy the reference's parameters and buffers into the candidate by name (default: nothing is "
                      "copied, as in KernelBench; differing ones are reported)"),
    click.Option(["--device"], type=click.Choice(["cpu", "cuda"]), default=None, help="run both models here"),
    click.Option(["--json", "json_path"], type=click.Path(dir_okay=False), default=None, help="write result.json here"),
    click.Option(["--csv", "csv_path"], type=click.Path(dir_okay=False), default=None,
                 help="write one CSV row per stage"),
    click.Option(["--strict"], is_flag=True, help="intermediate stages out of tolerance make the verdict diverged"),
    click.Option(["--full"], is_flag=True, help="print every stage (default: fold long models around the divergence)"),
    click.Option(["--tolerance"], type=click.Choice(["fixed", "auto"]), default="fixed", show_default=True,
                 help="auto: judge each stage against a float64 run of the reference (TorchDynamo's same() rule)"),
    click.Option(["--reinit-zero"], is_flag=True, help="give all-zero weight matrices random values for the diff"),
    click.Option(["--report-dir"], type=click.Path(file_okay=False), default=None,
                 help="write index.html, stages.csv, result.json, summary.md, junit.xml here "
                      "(default: reports/<candidate name>/)"),
    click.Option(["--no-report"], is_flag=True, help="write no report directory"),
    click.Option(["--html", "html_path"], type=click.Path(dir_okay=False), default=None,
                 help="write the HTML report here"),
    click.Option(["--markdown", "md_path"], type=click.Path(dir_okay=False), default=None,
                 help="write summary.md here"),
    click.Option(["--junit", "junit_path"], type=click.Path(dir_okay=False), default=None, help="write junit.xml here"),
    click.Option(["--no-isolate"], is_flag=True,
                 help="run in this process (default: in child processes, so a crashing kernel cannot take the "
                      "answer with it: one child for the whole diff first, streaming on a GPU; a child per side "
                      "when that one does not run clean)"),
    click.Option(["--timeout"], type=click.FloatRange(min=0), default=DEFAULT_TIMEOUT, show_default=True,
                 help="stop a side that runs longer than this (seconds; 0: never; with --no-isolate, the whole diff)"),
    click.Option(["--max-memory", "max_memory"], default=None, metavar="SIZE",
                 help="streaming diff: hold at most SIZE (e.g. 512M, 4G) of captured values on the device (CPU: in "
                      "memory); the rest goes to pinned host memory, then disk. Default without the flag: "
                      "in-memory diff on a CPU; on a GPU an isolated diff streams with the models' own size "
                      "(at least 1 GiB, at most a quarter of the free device memory)"),
    click.Option(["--device-memory", "device_memory"], default=None, metavar="SIZE",
                 help="take at most SIZE (e.g. 24G) of the GPU, as if the card had that much (to check a diff fits "
                      "a smaller card, or to share one); captured values that do not fit are streamed, then kept on "
                      "the host. Default: what is free on the card when the diff starts"),
    click.Option(["--stream", "stream"], is_flag=True,
                 help="streaming diff with the default budget (on a GPU what the models themselves hold there, "
                      "at least 1 GiB and at most a quarter of the free device memory; on a CPU a quarter of the "
                      "available memory)"),
    click.Option(["--only", "only"], default=None, metavar="PATTERNS",
                 help="capture only records whose names match these comma-separated globs (e.g. 'blocks.3.*'); "
                      "inputs and the output are always kept"),
    click.Option(["--stop-at-first"], is_flag=True, help="end the candidate's forward at its first divergent stage"),
    click.Option(["--sanitize"], type=click.Choice(["memcheck", "racecheck"]), default=None,
                 help="run the candidate's process under compute-sanitizer and attach its reports (kernel, thread, "
                      "address) to the stage that launched the kernel"),
    click.Option(["--explain/--no-explain", "explain"], default=None,
                 help="what-if runs of the reference on a divergence: plant one plausible kernel mistake at a time "
                      "(no bias, wrong axis, missing scale, transposed weight, unwritten tail …) and name the one "
                      "that reproduces the candidate (default: on when the divergent kernel covers several reference "
                      "stages)"),
    click.Option(["--stat", "stat"], type=click.Choice(["elementwise", "max", "mean", "median"]), default="elementwise",
                 show_default=True,
                 help="which statistic of the error must stay within tolerance, per stage and for the output: every "
                      "element (torch.allclose's rule, KernelBench's), or max/mean/median |c - r| <= atol + rtol x the "
                      "same statistic of |r|"),
    click.Option(["--explain-budget"], type=click.IntRange(min=0), default=Options.explain_budget, show_default=True,
                 help="forwards of the reference the what-if search may spend"),
    click.Option(["--explain-seconds"], type=click.FloatRange(min=0), default=Options.explain_seconds, show_default=True,
                 help="seconds the what-if search may spend: past them it tries no more variants and says how many it "
                      "left (0: no limit)"),
    click.Option(["--fold/--no-fold", "fold"], default=True, show_default=True,
                 help="fold the candidate's loop results that no reference record can pair with (a call site's results "
                      f"of sizes no reference record has, after its first {FOLD_AFTER}): their dataflow is "
                       "kept, no record is made "
                      "(--no-fold: record every one)"),
    click.Option(["--harden"], is_flag=True, default=Options.harden,
                 help="after KernelBench's verdict (unchanged), diff again under a matrix of settings applied to both "
                      "models alike (random constant parameters, another construction seed; scaled, shifted and "
                      "heavy-tailed inputs; other size constants; TF32 on a GPU) and say which break the candidate "
                      "and where; exit 1 when one does"),
]
