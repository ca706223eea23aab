"""`diloco bench ...`, `diloco bandwidth`, `diloco simulate-goodput`: the benchmark commands.

Contract: only the options live here; each command imports its benchmark (and torch) when it runs, so
`diloco --help` stays fast. A benchmark prints a table and writes JSON; a bad option is one line, exit 2.
"""

from __future__ import annotations

from pathlib import Path

import typer

from diloco.cli.errors import user_errors

bench = typer.Typer(no_args_is_help=True, help="Benchmarks: each prints a table and can write JSON.")
app = typer.Typer()
# bench quality's methods, in order; streaming-clock-*: the learners computing at once (the others take turns), at
# one speed and with half of them 2x slower (each learner's H from its speed: inner.dylu, the engine's default)
ALL_METHODS = "dp,sync-fp32,decoupled-int8,decoupled-int4,hetero-int4,streaming-clock-int4,streaming-clock-hetero-dylu"

@bench.command("codec")
def _bench_codec(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    num_params: int = typer.Option(10_000_000, "--num-params", min=1000, help="Model size (~40 MB fp32)."),
    num_steps: int = typer.Option(20, "--steps", min=1, help="AdamW inner steps behind the delta."),
    repeats: int = typer.Option(5, "--repeats", min=1, help="Timed repeats; the best counts."),
) -> None:
    """Encode and decode a realistic AdamW delta with every codec; print a table."""
    from diloco.bench.codec import bench_codec

    with user_errors():
        bench_codec(json_path=json_path, num_params=num_params, num_steps=num_steps, repeats=repeats)

@bench.command("goodput")
def _bench_goodput(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    quick: bool = typer.Option(False, "--quick", help="Smoke mode: the short plan (~90 s per run)."),
    storage: str = typer.Option("file://runs", "--storage", help="Where both runs live."),
    plan: Path | None = typer.Option(None, "--plan", help="A fault plan (default: the standard plan)."),
    checkpoint_cost_s: float = typer.Option(5.0, "--checkpoint-cost-s", min=0.0,
                                            help="Data-parallel checkpoint cost C for Young-Daly."),
    measure_runs: str | None = typer.Option(None, "--measure", metavar="CHAOS_RUN,CLEAN_RUN",
                                            help="Measure two recorded runs in --storage instead of running."),
) -> None:
    """Run the bench recipe under the standard fault plan and without faults; compare."""
    from diloco.bench.goodput import bench_goodput

    with user_errors():
        bench_goodput(json_path=json_path, quick=quick, storage=storage, plan=plan, checkpoint_cost_s=checkpoint_cost_s, measure_runs=measure_runs)

@bench.command("quality")
def _bench_quality(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    png_path: Path | None = typer.Option(None, "--png", help="Write the loss-vs-tokens plot here."),
    num_seeds: int = typer.Option(2, "--seeds", min=1, help="Seeds per method (a second is added when close)."),
    steps: int | None = typer.Option(None, "--steps", min=1,
                                     help="Inner steps per learner (= DP steps); default: the recipe's "
                                          "inner.total_steps."),
    tokens: int | None = typer.Option(None, "--tokens", min=1, help="Tokens per method (overrides --steps)."),
    learners: int | None = typer.Option(None, "--learners", min=1, help="M (default: the recipe's)."),
    methods: str = typer.Option(ALL_METHODS, "--methods", help="Comma-separated subset."),
    config: str = typer.Option("bench", "--config", help="Recipe name or YAML path."),
    quick: bool = typer.Option(False, "--quick", help="Smoke run: H=10, 20 steps per learner, 1 seed."),
    jobs: int = typer.Option(2, "--jobs", min=1, help="Run the methods of a seed in this many processes (2 = both cores)."),
) -> None:
    """Held-out loss and traffic at equal tokens: DP, sync DiLoCo, decoupled int8/int4 and heterogeneous (cohorts
    taking turns), streaming fragments with every learner computing at once."""
    from diloco.bench.quality import bench_quality

    with user_errors():
        bench_quality(json_path=json_path, png_path=png_path, num_seeds=num_seeds, steps=steps, tokens=tokens, learners=learners, methods=methods, config=config, quick=quick, jobs=jobs)

@bench.command("wan")
def _bench_wan(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    link_mb_s: float | None = typer.Option(None, "--link-mb-s", min=1e-6,
                                           help="Cap per learner link, MB/s each way (default: the cap at which "
                                                "DP's all-reduce takes 39.6x its compute, the paper's ratio)."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Inner steps per learner (default: the recipe's)."),
    step_time_s: float | None = typer.Option(None, "--step-time-s", min=1e-4,
                                             help="Emulated compute per inner step (each step is padded to "
                                                  "it; default 0.04 s)."),
    rtt_ms: float = typer.Option(2.0, "--rtt-ms", min=0.0, help="Round trip added to every store request."),
    config: str = typer.Option("bench", "--config", help="Recipe name or YAML path."),
    quick: bool = typer.Option(False, "--quick", help="Smoke run: H=10, 40 steps, 10 ms steps."),
    peer: bool = typer.Option(True, "--peer/--no-peer", help="Run torchft's DiLoCo too (skipped if not installed)."),
    seed: int | None = typer.Option(None, "--seed", help="Data seed (default: the recipe's)."),
    tokens_factor: float = typer.Option(1.0, "--tokens-factor",
                                        help="DiLoCo methods train this many times DP's tokens (1-10; "
                                             "default 1: equal tokens), to time them to DP's target past "
                                             "equal tokens."),
    caps: str = typer.Option("1,2,0.5", "--caps", help="The rows: caps as multiples of the paper-equivalent cap "
                                                       "(or of --link-mb-s), comma-separated; the first is the headline."),
    cohorts: bool = typer.Option(True, "--cohorts/--in-step", help="Decoupled learners in two cohorts half a phase "
                                                                    "apart (quorum M/2), as bench quality's "
                                                                    "streaming-clock-int4 drives them, or every "
                                                                    "learner in step."),
    fragments: int = typer.Option(8, "--fragments", help="Decoupled learners stream this many fragments (each shipped "
                                                         "every H steps, staggered, tau 2; one merger shard); 1: "
                                                         "whole-model deltas."),
    links: str = typer.Option("modelled", "--links", help="real: every learner and DP's gloo ranks in network "
                                                          "namespaces behind tbf-capped veth links to a real S3 "
                                                          "server (needs CAP_NET_ADMIN); modelled: a store wrapper "
                                                          "delays requests, DP's time is computed."),
    cut_s: float = typer.Option(0.0, "--cut-s", help="With --links real: learner 0's link goes down for this many "
                                                     "seconds mid-run (first cap) and across DP's steps."),
) -> None:
    """Time to a target loss behind a capped link: DP, sync and decoupled DiLoCo, torchft; links modelled or real."""
    from diloco.bench.wan import bench_wan, parse_cap_factors

    with user_errors():
        bench_wan(json_path=json_path, link_mb_s=link_mb_s, steps=steps, rtt_ms=rtt_ms, config=config, quick=quick,
                  peer=peer, seed=seed, tokens_factor=tokens_factor, cap_factors=parse_cap_factors(caps),
                  cohorts=cohorts, fragments=fragments, links=links, cut_s=cut_s,
                  **({} if step_time_s is None else {"step_time_s": step_time_s}))

@bench.command("merge")
def _bench_merge(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    sizes: str = typer.Option("bench,10m", "--sizes", help="Comma-separated model sizes: bench, 10m, tiny."),
    learners: str = typer.Option("2,4,8,16,32,64", "--learners", help="Comma-separated learner counts."),
    codec: str = typer.Option("int4", "--codec", help="Delta codec of the synthetic deltas."),
) -> None:
    """Time and peak memory of one merge against the number of learners and the model size."""
    from diloco.bench.merge import bench_merge

    with user_errors():
        bench_merge(json_path=json_path, sizes=sizes, learners=learners, codec=codec)

@bench.command("poll")
def _bench_poll(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    storage: str | None = typer.Option(None, "--storage", help="Where (s3://bucket/prefix, file://DIR); default a "
                                       "temporary folder."),
    moto: bool = typer.Option(False, "--moto", help="Start moto's S3 server in this process and use it (dev dependency)."),
    learners: int = typer.Option(3, "--learners", min=1, help="Learners the deltas are spread over."),
    deltas: str = typer.Option("1000,5000,10000", "--deltas", help="Comma-separated numbers of deltas in the run."),
    repeats: int = typer.Option(5, "--repeats", min=1, help="Polls timed per row (the median is reported)."),
    versions: str = typer.Option("1000,5000,10000", "--versions", help="Comma-separated numbers of versions in the "
                                 "chain, for the stop check's poll ('' for none)."),
) -> None:
    """What one merger poll and one stop check cost against the run's length: every key listed, or after the
    cursor / the version known."""
    from diloco.bench.poll import bench_poll

    with user_errors():
        bench_poll(json_path=json_path, storage=storage, moto=moto, learners=learners, deltas=deltas, repeats=repeats,
                   versions=versions)

@bench.command("scale")
def _bench_scale(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    params: str = typer.Option("124m", "--params", help="Model size: 124m (GPT-2 small's shape and vocabulary), 10m."),
    learners: int = typer.Option(8, "--learners", min=1, help="Synthetic int4 deltas per fragment and round."),
    fragments: str = typer.Option("1,4,12,24", "--fragments", help="Comma-separated fragment counts P."),
    quick: bool = typer.Option(False, "--quick", help="A small model instead (seconds; the tests use it)."),
    checkpoint_every: int | None = typer.Option(
        None, "--checkpoint-every", min=1,
        help="K (state.checkpoint_every; default the recipe's): 3K rounds."),
) -> None:
    """Merge memory and time, bucket growth, a merger's restart, a learner's rejoin and peak upload against
    the number of fragments (3K rounds per P by the production merger)."""
    from diloco.bench.scale import bench_scale

    with user_errors():
        bench_scale(json_path=json_path, params=params, learners=learners, fragments=fragments, quick=quick,
                    checkpoint_every=checkpoint_every)

@bench.command("outage")
def _bench_outage(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    at: int = typer.Option(8, "--at", min=1, help="Round at which the merger goes down."),
    down: int = typer.Option(6, "--down", min=1, help="Rounds without a merge."),
    rounds: int = typer.Option(24, "--rounds", min=2, help="Rounds in all."),
    config: str = typer.Option("bench", "--config", help="Recipe name or YAML path."),
    jobs: int = typer.Option(2, "--jobs", min=1, help="Rules run side by side in this many processes."),
) -> None:
    """Merger outage: the held-out loss around a backlog merge, momentum taking it whole vs at a round's rate."""
    from diloco.bench.outage import bench_outage

    with user_errors():
        bench_outage(json_path=json_path, at=at, down=down, rounds=rounds, config=config, jobs=jobs)

@app.command("bandwidth")
def _bandwidth(
    num_params: float = typer.Option(..., "--params", min=1, help="Model parameters, e.g. 12e9."),
    step_time_s: float = typer.Option(..., "--step-time-s", min=1e-6, help="Seconds per inner step."),
    num_learners: int = typer.Option(..., "--learners", min=1, help="Learners (sites) M."),
    inner_steps: int = typer.Option(..., "--inner-steps", min=1, help="H: inner steps per phase."),
    codec: str = typer.Option("int4", "--codec", help="Delta codec: fp32, bf16, int8, int4, int3, int2, nf2."),
    update_codec: str = typer.Option("fp32", "--update-codec", help="Codec of the compact update sent back."),
    busy: float = typer.Option(0.95, "--busy", min=0.01, max=0.99, help="Fraction of time learners compute."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the row as JSON here."),
    checkpoint_every: int | None = typer.Option(
        None, "--checkpoint-every", min=1, help="K of the bucket growth (default: from the update codec)."),
) -> None:
    """Bandwidth needed between sites: data-parallel all-reduce vs one delta per H steps; and the bucket's
    growth."""
    from diloco.bench.bandwidth import bandwidth

    with user_errors():
        bandwidth(num_params=num_params, step_time_s=step_time_s, num_learners=num_learners,
                  inner_steps=inner_steps, codec=codec, update_codec=update_codec, busy=busy,
                  json_path=json_path, checkpoint_every=checkpoint_every)

@app.command("simulate-goodput")
def _simulate_goodput(
    json_path: Path | None = typer.Option(None, "--json", help="Write the table as JSON here."),
    plot_path: Path | None = typer.Option(None, "--plot", help="Write a PNG of goodput against chips here."),
    mtbf_years: float = typer.Option(
        1.0, "--mtbf-years", min=1e-6, help="Per-chip mean time between failures."
    ),
    restart_s: float | None = typer.Option(None, "--restart-s", min=0.0, help="Data-parallel restart time."),
    seed: int = typer.Option(0, "--seed", help="Base seed; every cell derives its own."),
    num_failures: int | None = typer.Option(None, "--num-failures", min=1, help="Monte Carlo size per cell."),
    sweep: bool = typer.Option(False, "--sweep", help="Add goodput vs per-chip MTBF and vs recovery time."),
) -> None:
    """Goodput of data-parallel, elastic data-parallel and Decoupled DiLoCo at 150k-2.4M chips."""
    from diloco.sim.cli import simulate_goodput

    with user_errors():
        simulate_goodput(json_path=json_path, plot_path=plot_path, mtbf_years=mtbf_years, restart_s=restart_s, seed=seed, num_failures=num_failures, sweep=sweep)


@bench.command("ranks")
def _bench_ranks(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    config: str = typer.Option("bench", "--config", help="Recipe name or YAML path."),
    phases: int = typer.Option(6, "--phases", min=2, help="Phases per learner (the first is not measured)."),
    overrides: list[str] = typer.Option([], "-o", "--override", help="key=value of the recipe (repeatable), "
                                        "e.g. -o model.d_model=256."),
) -> None:
    """Tokens/s of one learner with 1 and with 2 ranks (torch.distributed inside the learner)."""
    from diloco.bench.ranks import bench_ranks
    from diloco.configs import parse_overrides

    with user_errors():
        bench_ranks(json_path=json_path, config=config, phases=phases, overrides=parse_overrides(list(overrides)))


@bench.command("startup")
def _bench_startup(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    config: str = typer.Option("demo", "--config", help="Recipe name or YAML path (default: what make run trains)."),
    prefect: bool = typer.Option(True, "--prefect/--no-prefect", help="With a local Prefect server, as make run."),
    imports: bool = typer.Option(True, "--imports/--no-imports", help="Also time each heavy import apart."),
    prepared: bool = typer.Option(True, "--prepared/--fresh-home",
                                  help="Prefect's home as make setup leaves it (its database created), or empty."),
) -> None:
    """Run the main job once and print where its wall time goes (server, flows, process starts, imports)."""
    from diloco.bench.startup import bench_startup

    with user_errors():
        bench_startup(config=config, prefect=prefect, json_path=json_path, imports=imports, prepared=prepared)


@bench.command("moments")
def _bench_moments(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    config: str = typer.Option("bench", "--config", help="The recipe."),
    before: int = typer.Option(2400, "--before", min=2, help="Steps trained before the host is lost."),
    after: int = typer.Option(80, "--after", min=1, help="Steps trained after the resume, each variant."),
) -> None:
    """What a lost host's resume loses with exact, int8, C-phase-old or no checkpointed moments, per byte."""
    from diloco.bench.moments import bench_moments

    with user_errors():
        bench_moments(json_path=json_path, config=config, before=before, after=after)


@bench.command("size")
def _bench_size(
    json_path: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    params: str = typer.Option("124m", "--params", help="124m (GPT-2 small's shape), 10m or quick."),
    learners: int = typer.Option(2, "--learners", min=1, help="Learners (one is killed and restarted)."),
    fragments: str = typer.Option("1,4", "--fragments", help="Fragment counts, one row each (e.g. 1,4)."),
    device: str = typer.Option("cpu", "--device", help="The learners' device: cpu, or cuda (the GPU check)."),
    steps: int = typer.Option(48, "--steps", min=8, help="Inner steps per learner: the token budget."),
    storage: str | None = typer.Option(None, "--storage", help="Where the runs live (default: a temp dir)."),
    time_limit_s: float = typer.Option(900.0, "--time-limit-s", min=30.0, help="Each run's time limit."),
    kill_at: int | None = typer.Option(None, "--kill-at-version", min=1,
                                       help="Kill a learner once this version is committed (default: a "
                                            "third in)."),
) -> None:
    """A 124M model end to end through `diloco run`: memory per parameter, uploads against deltas, bucket
    growth."""
    from diloco.bench.size import bench_size

    with user_errors():
        bench_size(json_path=json_path, params=params, learners=learners, fragments=fragments, device=device,
                   storage=storage, steps=steps, time_limit_s=time_limit_s, kill_at=kill_at)
