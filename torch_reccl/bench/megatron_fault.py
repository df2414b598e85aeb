"""Megatron-LM through a NIC failure: the loss of every iteration against a fault-free run.

Runs Megatron-LM's own pretrain_gpt.py (a checkout's folder, given by --megatron-dir)
through examples/megatron/pretrain_gpt_reccl.py, 2 ranks started without torchrun,
each its own "host" to NCCL (own NCCL_HOSTID, P2P and SHM off, NVLink multicast off),
so every byte between them crosses torch_reccl's net plugin over the loopback NICs
127.0.0.1 and 127.0.0.2; with one GPU both ranks share it. For each layout
(data-parallel 2, tensor-parallel 2) it trains a tiny GPT (2 layers, hidden 128,
4 heads, sequence 128, micro batch 2, mock data, NullTokenizer, bf16, no Transformer
Engine or Apex) twice: fault-free, then with the launcher's fault schedule (default
rank 0's NIC 0 down before iteration 101, up before 201, by inject_fault: there is no
`ip` on the GPU machine, so no network namespaces). It compares the "lm loss" Megatron
logs at every iteration (--log-interval 1), and reports the step-time spike around
each fault, failovers and failbacks (every rank's events), exit codes and whether
any log shows a "Broken pipe". With wandb importable, the fault run also logs to an
offline W&B run (WANDB_MODE=offline; Megatron's own run on the last rank, the
events under reccl/).

    python bench/megatron_fault.py --megatron-dir .vendor/megatron --json megatron_fault.json

Every run is bounded (--timeout-s; ranks still running then are killed). Exit
status 0 only when every comparison holds. bench/megatron_fault.py runs main(); the
tests (tests/tools/test_examples.py on the stand-in checkout, tests/gpu/test_megatron_failover.py
on Megatron-LM) run run_pair.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from torch_reccl.cli.launch import free_port

# The checkout holding this package: the launcher is its example, and the ranks import
# torch_reccl from it.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "examples", "megatron", "pretrain_gpt_reccl.py")
DEFAULT_SCHEDULE = "h0nic0:down@step 100,h0nic0:up@step 200"
LOOPBACK_NICS = "127.0.0.1,127.0.0.2"
# Megatron-LM main without Transformer Engine or Apex (issue 18), a tiny GPT.
TINY_GPT = ["--transformer-impl", "local", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "4096", "--bf16", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-persist-layer-norm", "--split", "100,0,0",
            "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
            "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "constant", "--seed", "1234",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
            "--distributed-timeout-minutes", "5"]
LAYOUTS = {"dp2": ["--tensor-model-parallel-size", "1"], "tp2": ["--tensor-model-parallel-size", "2"]}
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+0-9.eE]+)")
KILL_GRACE_S = 10.0


def rank_env(rank: int, world: int, port: int, label: str, megatron_dir: str, gpus: int) -> Dict[str, str]:
    """One rank that looks like its own host to NCCL, started without torchrun."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "CUDA_VISIBLE_DEVICES": str(rank % gpus), "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_HOSTID": f"{label}-{rank}", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo", "NCCL_NET": "ReCCL",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RECCL_NICS": LOOPBACK_NICS, "RECCL_HEARTBEAT_MS": "500", "OMP_NUM_THREADS": "2",
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, megatron_dir, os.environ.get("PYTHONPATH")])),
    }


class VethLink:
    """Real link faults for the fault run: both ranks run in a 2-host emulated fabric
    (network namespaces, veths, bridges; torch_reccl.fabric, needs root and pyroute2),
    NCCL's bootstrap and the store on its management network, our NICs eth0/eth1.
    Rank 0 writes the iterations done to a file (the launcher's --reccl-fault-driver);
    ``poll`` makes each scheduled fault (the drill's FabricFaults) once its step is done."""
    POLL_S = 0.002

    def __init__(self, fabric, out_dir: str):
        from torch_reccl.drill.faults import FabricFaults

        self.fabric = fabric
        self.faults = FabricFaults(fabric, flap_period_s=1.0, flap_count=4)
        self.progress_path = os.path.join(out_dir, "progress")
        self.pending: List = []
        self.made: List[dict] = []
        self.env = {"MASTER_ADDR": fabric.mgmt_ip(0), "NCCL_SOCKET_IFNAME": fabric.mgmt_name,
                    "GLOO_SOCKET_IFNAME": fabric.mgmt_name,
                    "RECCL_NICS": ",".join(fabric.nic_name(r) for r in range(fabric.rails))}

    def arm(self, schedule: str) -> List[str]:
        """The launcher arguments for a run with this schedule ('' for fault-free)."""
        from torch_reccl.drill.schedule import parse_schedule

        self.pending, self.made = parse_schedule(schedule), []
        if os.path.exists(self.progress_path):
            os.remove(self.progress_path)
        return ["--reccl-fault-driver", self.progress_path] if self.pending else []

    def poll(self) -> None:
        from torch_reccl.drill.schedule import take_due

        try:
            with open(self.progress_path) as f:
                done = int(f.read())
        except (OSError, ValueError):
            return
        for fault in take_due(self.pending, 0.0, done):
            self.made.append({"fault": fault.text, "iterations_done": done, "what": self.faults.apply(fault)})

    def heal(self) -> None:
        self.faults.heal_all()


def run_job(megatron_dir: str, out_dir: str, label: str, launcher_args: List[str], script_args: List[str],
            timeout_s: float, world: int = 2, gpus: int = 1,
            extra_env: Optional[Dict[str, str]] = None, link: Optional["VethLink"] = None) -> dict:
    """Runs the launcher on `world` ranks from `megatron_dir` (its pretrain_gpt.py);
    each rank's log goes to out_dir/label-RANK.log. Ranks still running after
    `timeout_s` are killed (their whole process group). With `link`, rank r runs in
    the fabric's host r and the link's driver is polled while the ranks run."""
    megatron_dir = os.path.abspath(megatron_dir)
    os.makedirs(out_dir, exist_ok=True)
    port = free_port()
    paths = [os.path.join(out_dir, f"{label}-{rank}.log") for rank in range(world)]
    command = [sys.executable, "-X", "faulthandler", LAUNCHER,
               "--reccl-script", os.path.join(megatron_dir, "pretrain_gpt.py"), *launcher_args, *script_args]
    procs = []
    started = time.monotonic()
    try:
        for rank in range(world):
            env = {**os.environ, **rank_env(rank, world, port, label, megatron_dir, gpus), **(extra_env or {}),
                   **(link.env if link else {})}
            with open(paths[rank], "w") as log:
                start = functools.partial(link.fabric.popen, rank) if link else subprocess.Popen
                procs.append(start(command, cwd=megatron_dir, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True))
        deadline = started + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if link:
                link.poll()
            time.sleep(VethLink.POLL_S if link else 0.2)
    finally:
        if link:
            link.heal()
        hung = [rank for rank, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            try:
                p.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
    logs = []
    for path in paths:
        with open(path, errors="replace") as f:
            logs.append(f.read())
    return {"label": label, "seconds": time.monotonic() - started, "hung": hung,
            "returncodes": [p.returncode for p in procs], "logs": logs, "log_paths": paths}


def losses(log: str) -> Dict[int, str]:
    """Iteration -> "lm loss" as Megatron logged it (the last rank's log)."""
    return {int(i): value for i, value in LOSS_RE.findall(log)}


def compare_losses(clean: Dict[int, str], faulted: Dict[int, str]) -> dict:
    common = sorted(set(clean) & set(faulted))
    differ = [i for i in common if clean[i] != faulted[i]]
    return {"iterations_compared": len(common), "identical": bool(common) and not differ
            and set(clean) == set(faulted), "first_difference": differ[0] if differ else None,
            "differing_iterations": len(differ)}


def failure(run: dict) -> Optional[str]:
    """Why a run did not end well (a rank hung or exited non-zero), with log tails; or None."""
    if not run["hung"] and all(code == 0 for code in run["returncodes"]):
        return None
    tails = "\n".join(f"--- rank {rank} ({'hung, killed' if rank in run['hung'] else 'exit ' + str(code)})\n"
                      f"{log[-4000:]}" for rank, (code, log) in enumerate(zip(run["returncodes"], run["logs"])))
    return f"the {run['label']} run failed after {run['seconds']:.0f} s:\n{tails}"


def run_pair(megatron_dir: str, out_dir: str, layout: str, iterations: int, schedule: str, timeout_s: float,
             gpus: int, wandb_dir: Optional[str] = None, megatron_args: Optional[List[str]] = None,
             log: Callable[[str], None] = print, link: Optional[VethLink] = None) -> dict:
    """The layout fault-free, then with the schedule (by inject_fault, or real link
    faults with `link`); their comparison."""
    script_args = (megatron_args if megatron_args is not None else TINY_GPT + LAYOUTS[layout]) + [
        "--train-iters", str(iterations)]
    if megatron_args is None:
        script_args += ["--global-batch-size", str(2 * (2 if layout == "dp2" else 1))]
    runs = {}
    for mode in ("fault_free", "fault"):
        label = f"{layout}-{mode}"
        report = os.path.join(out_dir, f"{label}-report.json")
        launcher_args = ["--reccl-report", report]
        extra_args, extra_env = [], {}
        if link:
            launcher_args += link.arm(schedule if mode == "fault" else "")
        if mode == "fault":
            launcher_args += ["--reccl-fault-schedule", schedule]
            if wandb_dir:
                launcher_args.append("--reccl-wandb")
                extra_args = ["--wandb-project", "reccl-megatron", "--wandb-exp-name", label,
                              "--wandb-save-dir", wandb_dir]
                extra_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        log(f"[megatron_fault] {label}: {iterations} iterations ...")
        run = run_job(megatron_dir, out_dir, label, launcher_args, script_args + extra_args, timeout_s,
                      gpus=gpus, extra_env=extra_env, link=link)
        run["link_faults"] = list(link.made) if link else None
        run["report"] = None
        if os.path.exists(report):
            with open(report) as f:
                run["report"] = json.load(f)
        run["losses"] = losses(run["logs"][-1])
        run["broken_pipe_lines"] = sum(text.count("Broken pipe") for text in run["logs"])
        runs[mode] = run
        log(f"[megatron_fault] {label}: exit codes {run['returncodes']}, {run['seconds']:.0f} s, "
            f"{len(run['losses'])} losses logged")
        if failure(run):
            break
    return {"layout": layout, "runs": runs,
            "losses": compare_losses(runs["fault_free"]["losses"], runs["fault"]["losses"])
            if "fault" in runs else None}


def verdict(pair: dict, iterations: int) -> List[str]:
    """What is wrong with a pair of runs (empty: all good)."""
    problems = []
    for run in pair["runs"].values():
        why = failure(run)
        if why:
            problems.append(why)
        elif run["report"] is None:
            problems.append(f"{run['label']}: no --reccl-report written")
        if run["broken_pipe_lines"]:
            problems.append(f"{run['label']}: {run['broken_pipe_lines']} 'Broken pipe' lines in the logs")
        if not failure(run) and len(run["losses"]) != iterations:
            problems.append(f"{run['label']}: {len(run['losses'])} losses logged, expected {iterations}")
    if problems or pair["losses"] is None:
        return problems
    if not pair["losses"]["identical"]:
        problems.append(f"{pair['layout']}: the fault run's loss differs from the fault-free run's at "
                        f"iteration {pair['losses']['first_difference']} "
                        f"({pair['losses']['differing_iterations']} iterations differ)")
    events = pair["runs"]["fault"]["report"]["events"]
    clean_events = pair["runs"]["fault_free"]["report"]["events"]
    if not events["failover"] or not events["failback"]:
        problems.append(f"{pair['layout']}: fault run events {events}: expected failovers and failbacks")
    if clean_events["failover"] or clean_events["nic_down"]:
        problems.append(f"{pair['layout']}: fault-free run events {clean_events}: a failover without a fault")
    return problems


# A run stopped and resumed from its last checkpoint must be the same job: RESUME_ITERATIONS
# iterations saved every RESUME_SAVE_INTERVAL, stopped by Megatron's --exit-interval at
# EXIT_AT, or by the launcher's policy right after a NIC is lost for good before iteration
# RESUME_FAULT_AT + 1 (rule "restart": exit 75 at once, resume from the checkpoint before).
RESUME_ITERATIONS, RESUME_SAVE_INTERVAL, EXIT_AT, RESUME_FAULT_AT = 60, 20, 40, 25
RESUME_CKPT = ["--ckpt-format", "torch", "--save-interval", str(RESUME_SAVE_INTERVAL), "--exit-signal-handler"]
RESUME_POLICY = ["--reccl-policy", "restart"]
GRAD_NORM_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([-+0-9.eE]+)")
# Megatron prints the loss with 7 significant digits.
PRINTED_LOSS_RTOL = 1e-6


def final_model(megatron_dir: str, folder: str, iteration: int) -> Optional[dict]:
    """The model's state dict in a --ckpt-format torch checkpoint (tensors on the CPU), or
    None. The checkpoint pickles Megatron's objects (its arguments): unpickling imports
    megatron from the checkout."""
    import torch

    path = os.path.join(folder, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    if not os.path.exists(path):
        return None
    if megatron_dir not in sys.path:
        sys.path.append(megatron_dir)
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def same_parameters(a: dict, b: dict) -> List[str]:
    """The tensors of two model state dicts that differ (by name), bit for bit."""
    import torch

    tensors = sorted(k for k, v in a.items() if isinstance(v, torch.Tensor))
    differ = [k for k in tensors if not isinstance(b.get(k), torch.Tensor) or not torch.equal(a[k], b[k])]
    return differ + sorted(k for k, v in b.items() if isinstance(v, torch.Tensor) and k not in a)


def run_resume(megatron_dir: str, out_dir: str, timeout_s: float, gpus: int,
               log: Callable[[str], None] = print) -> dict:
    """Megatron's checkpoint and resume, data-parallel 2: uninterrupted; stopped at
    EXIT_AT by Megatron's own --exit-interval, then resumed; stopped by the launcher's
    --reccl-policy after rank 0's NIC is lost for good, then resumed without the fault.
    Each pair shares its own checkpoint folder."""
    script = TINY_GPT + LAYOUTS["dp2"] + RESUME_CKPT + ["--train-iters", str(RESUME_ITERATIONS),
                                                         "--global-batch-size", "4"]
    folders = {name: os.path.join(out_dir, f"resume-{name}-ckpt") for name in ("uninterrupted", "megatron", "policy")}

    def ckpt(name: str) -> List[str]:
        return ["--save", folders[name], "--load", folders[name]]

    plan = [("uninterrupted", "uninterrupted", [], []),
            ("megatron_exit", "megatron", [], ["--exit-interval", str(EXIT_AT)]),
            ("megatron_resume", "megatron", [], []),
            ("policy_exit", "policy", RESUME_POLICY + ["--reccl-fault-schedule", f"h0nic0:down@step {RESUME_FAULT_AT}"],
             []),
            ("policy_resume", "policy", RESUME_POLICY, [])]
    runs = {}
    for name, folder, launcher_args, extra in plan:
        log(f"[megatron_fault] resume-{name} ...")
        run = run_job(megatron_dir, out_dir, f"resume-{name}", launcher_args, script + ckpt(folder) + extra,
                      timeout_s, gpus=gpus)
        run["losses"] = losses(run["logs"][-1])
        run["grad_norms"] = {int(i): v for i, v in GRAD_NORM_RE.findall(run["logs"][-1])}
        runs[name] = run
        log(f"[megatron_fault] resume-{name}: exit codes {run['returncodes']}, {run['seconds']:.0f} s, "
            f"iterations {min(run['losses'], default=None)}-{max(run['losses'], default=None)}")
    models = {name: final_model(megatron_dir, folder, RESUME_ITERATIONS) for name, folder in folders.items()}
    return {"runs": runs, "models": models}


def logged_like(clean: Dict[int, str], run: Dict[int, str]) -> List[int]:
    """The iterations whose logged loss is not the uninterrupted run's. Megatron does not
    reset its loss accumulator after the first iteration a process trains (training_log's
    ``should_reset = not is_first_iteration``), so with --log-interval 1 the second
    iteration after any start logs the mean of the first two: in a resumed run that one
    is compared with the mean of the uninterrupted run's two, to the printed precision."""
    first = min(run, default=0)
    resumed = first > min(clean, default=0)
    differ = []
    for i, value in run.items():
        if resumed and i == first + 1 and first in clean and i in clean:
            expected = (float(clean[first]) + float(clean[i])) / 2
            if abs(float(value) - expected) > PRINTED_LOSS_RTOL * abs(expected):
                differ.append(i)
        elif clean.get(i) != value:
            differ.append(i)
    return sorted(differ)


def resume_verdict(result: dict) -> List[str]:
    """What is wrong with run_resume's runs (empty: all good)."""
    runs = result["runs"]
    problems = []
    expected = {"uninterrupted": (0, 1, RESUME_ITERATIONS), "megatron_exit": (0, 1, EXIT_AT),
                "megatron_resume": (0, EXIT_AT + 1, RESUME_ITERATIONS),
                "policy_exit": (75, 1, None),  # the policy stops at the step that sees the fault
                "policy_resume": (0, RESUME_FAULT_AT - RESUME_FAULT_AT % RESUME_SAVE_INTERVAL + 1,
                                  RESUME_ITERATIONS)}
    for name, run in runs.items():
        code, first, last = expected[name]
        if run["hung"] or any(c != code for c in run["returncodes"]):
            problems.append(f"resume-{name}: exit codes {run['returncodes']} (hung {run['hung']}), expected "
                            f"{code} on every rank; log tail:\n{run['logs'][-1][-3000:]}")
            continue
        span = (min(run["losses"], default=0), max(run["losses"], default=0))
        if last is None and not RESUME_FAULT_AT <= span[1] < RESUME_FAULT_AT + RESUME_SAVE_INTERVAL:
            problems.append(f"resume-{name}: stopped after iteration {span[1]}, expected soon after the fault "
                            f"before iteration {RESUME_FAULT_AT + 1}")
        if span[0] != first or (last is not None and span[1] != last) or len(run["losses"]) != span[1] - span[0] + 1:
            problems.append(f"resume-{name}: iterations {span[0]}-{span[1]} logged ({len(run['losses'])} losses), "
                            f"expected {first}-{last or 'the stop'}")
    if problems:
        return problems
    clean = runs["uninterrupted"]
    for name, run in runs.items():
        if name == "uninterrupted":
            continue
        differ = logged_like(clean["losses"], run["losses"])
        if differ:
            problems.append(f"resume-{name}: logged loss differs from the uninterrupted run's at iterations {differ}")
        norms = [i for i, v in run["grad_norms"].items() if clean["grad_norms"].get(i) != v]
        if norms:
            problems.append(f"resume-{name}: grad norm differs from the uninterrupted run's at iterations {norms}")
    models = result["models"]
    for name in ("uninterrupted", "megatron", "policy"):
        if models[name] is None:
            problems.append(f"resume-{name}: no checkpoint of iteration {RESUME_ITERATIONS}")
    if not problems:
        for name in ("megatron", "policy"):
            differ = same_parameters(models["uninterrupted"], models[name])
            if differ:
                problems.append(f"resume-{name}: final parameters differ from the uninterrupted run's in "
                                f"{len(differ)} tensors, e.g. {differ[:3]}")
    return problems


def table(pairs: List[dict]) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.1f}"

    rows = [f"{'layout':6s} {'run':10s} {'exit':6s} {'loss = fault-free':17s} {'median ms':9s} "
            f"{'fault: max ms (x median)':28s} {'failovers':9s} {'failbacks':9s}"]
    for pair in pairs:
        for mode, run in pair["runs"].items():
            report = run["report"] or {"fault_free_median_step_s": None, "faults": [],
                                       "events": {"failover": "-", "failback": "-"}}
            spikes = ", ".join(f"{ms(f['max_step_s'])} ({f['vs_fault_free'] or 0:.1f}x)" for f in report["faults"])
            same = "-" if mode == "fault_free" or pair["losses"] is None else (
                f"yes ({pair['losses']['iterations_compared']})" if pair["losses"]["identical"] else "NO")
            rows.append(f"{pair['layout']:6s} {mode:10s} {','.join(map(str, run['returncodes'])):6s} {same:17s} "
                        f"{ms(report['fault_free_median_step_s']):9s} {spikes or '-':28s} "
                        f"{report['events']['failover']!s:9s} {report['events']['failback']!s:9s}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-dir", required=True,
                        help="a Megatron-LM checkout's folder (pretrain_gpt.py, megatron/, gpt_builders.py, "
                             "model_provider.py)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--fault", default=DEFAULT_SCHEDULE,
                        help=f"the launcher's --reccl-fault-schedule (default {DEFAULT_SCHEDULE!r})")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--gpus", type=int, default=1, help="GPUs to spread the 2 ranks over (default 1: shared)")
    parser.add_argument("--timeout-s", type=float, default=420.0, help="bound on each run")
    parser.add_argument("--out-dir", default="megatron_fault_runs", help="logs, reports, W&B runs")
    parser.add_argument("--wandb", choices=["auto", "on", "off"], default="auto",
                        help="offline W&B run for each fault run (auto: when wandb is importable)")
    parser.add_argument("--link", choices=["auto", "inject", "veth"], default="auto",
                        help="how the NIC fails: inject (torch_reccl.inject_fault in the ranks, loopback "
                             "NICs), veth (a real veth down in an emulated 2-host fabric: root, pyroute2, "
                             "network namespaces); auto: veth where possible")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the result record here")
    parser.add_argument("--resume", action="store_true",
                        help="instead: Megatron's checkpoint and resume, uninterrupted against stopped "
                             f"(at iteration {EXIT_AT} by --exit-interval; by --reccl-policy restart after a "
                             "NIC lost for good) and resumed: losses, grad norms and final parameters must "
                             "match (inject_fault)")
    args = parser.parse_args(argv)
    megatron_dir = os.path.abspath(args.megatron_dir)
    if not os.path.isfile(os.path.join(megatron_dir, "pretrain_gpt.py")):
        parser.error(f"--megatron-dir {args.megatron_dir}: no pretrain_gpt.py there (a Megatron-LM checkout's root)")
    out_dir = os.path.abspath(args.out_dir)
    wandb_dir = None
    if args.wandb == "on" or (args.wandb == "auto" and importlib.util.find_spec("wandb") is not None):
        wandb_dir = os.path.join(out_dir, "wandb")
        os.makedirs(wandb_dir, exist_ok=True)
    command = "python bench/megatron_fault.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.resume:
        return resume_main(megatron_dir, out_dir, args, command)
    pairs, problems = [], []
    fabric = start_fabric(args.link)
    args.link = "veth" if fabric else "inject"
    try:
        link = VethLink(fabric, out_dir) if fabric else None
        for layout in args.layouts:
            pair = run_pair(megatron_dir, out_dir, layout, args.iterations, args.fault, args.timeout_s, args.gpus,
                            wandb_dir, link=link)
            pairs.append(pair)
            problems += verdict(pair, args.iterations)
            if args.json:  # after each layout, so a run cut short still leaves what it did
                write_record(args.json, command, args, wandb_dir, pairs, problems,
                             done=layout == args.layouts[-1])
    finally:
        if fabric:
            fabric.down()
    print(table(pairs))
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 0 if not problems else 1


def resume_main(megatron_dir: str, out_dir: str, args, command: str) -> int:
    result = run_resume(megatron_dir, out_dir, args.timeout_s, args.gpus)
    problems = resume_verdict(result)
    for name, run in result["runs"].items():
        print(f"{name:16s} exit {','.join(map(str, run['returncodes'])):6s} iterations "
              f"{min(run['losses'], default='-')}-{max(run['losses'], default='-')}")
    print("final parameters (iteration %d checkpoint) = uninterrupted: %s" % (
        RESUME_ITERATIONS, "yes" if not problems else "see the problems"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"command": command}, "ok": not problems, "problems": problems,
                       "runs": {name: {k: v for k, v in run.items() if k != "logs"}
                                for name, run in result["runs"].items()}}, f, indent=1)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 0 if not problems else 1


def start_fabric(link: str):
    """The emulated fabric for --link veth (or auto where it can be built), else None."""
    if link == "inject":
        return None
    from torch_reccl.fabric import Fabric, FabricError, require_root

    try:
        require_root()
        return Fabric(hosts=2, rails=2, name="meg").up()
    except FabricError as error:
        if link == "veth":
            raise SystemExit(f"megatron_fault.py: --link veth: {error}")
        print(f"[megatron_fault] --link auto: inject_fault ({error})", file=sys.stderr)
        return None


def write_record(path: str, command: str, args, wandb_dir: Optional[str], pairs: List[dict], problems: List[str],
                 done: bool) -> None:
    record = {"meta": {"command": command, "schedule": args.fault, "iterations": args.iterations, "link": args.link,
                       "layouts": args.layouts, "wandb_dir": wandb_dir, "complete": done},
              "ok": done and not problems, "problems": problems,
              "results": [{"layout": p["layout"], "losses": p["losses"],
                           "runs": {mode: {k: v for k, v in run.items() if k != "logs"}
                                    for mode, run in p["runs"].items()}} for p in pairs]}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
