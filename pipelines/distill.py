"""The distillation pipeline (KFP v2): validate inputs -> init student (moved onto the student
tokenizer first for tokenizer transfer) -> prepare -> per teacher: tables -> validate ->
X-Token's projection; scoring fanned out over teachers x shard ranges -> merge -> per run (kd,
ce): train as a PyTorchJob (or, ``job_kind: trainjob``, a Kubeflow Trainer v2 TrainJob) ->
evaluate -> report. ``crosskd pipeline compile`` writes ``distill.yaml``.

Per-task settings: caching on for the pure steps (init_student, plan_tables, build_tables,
validate_tables, build_projection, prepare, plan_scoring, score_teacher, merge_cache: their
outputs are content-addressed), off for validate_inputs, plan_training, train, evaluate and
report; retries with backoff on the steps that mostly move data (init_student, build_tables,
prepare, merge_cache, report) and on the training launcher (it reattaches to its job), none on the
GPU-bound steps; the GPU steps (score_teacher, evaluate) get the accelerator, node selector and
tolerations from parameters, ``/dev/shm`` in memory and a timeout; every step gets the S3
credentials from the Secret named by ``s3_secret``. The training task is a CPU-only launcher:
its GPUs, nodes, tolerations and node selector go into the job it renders (``job``). The
defaults are a CPU smoke run (random-init models, standard-library text) that runs on the
project image anywhere; ``params/*.yaml`` are parameter sets for real runs.

``distill_served`` is the same run with teacher servers instead of caches (``crosskd pipeline
compile --teacher-serving server``): no scoring; ``start_teacher_server`` brings up one
``crosskd serve`` Deployment per teacher and gives the training runs their URLs, and
``stop_teacher_server`` takes them down after training (before the GPU evaluation) and, as the
exit task of a ``dsl.ExitHandler`` around everything from the start on, once more whatever
happened (a failed start or training included).
"""

from kfp import dsl, kubernetes
from kfp.dsl.pipeline_channel import PipelineChannel

from components.build_projection.component import build_projection
from components.build_tables.component import build_tables
from components.evaluate.component import evaluate
from components.init_student.component import init_student
from components.merge_cache.component import merge_cache
from components.plan_scoring.component import plan_scoring
from components.plan_tables.component import plan_tables
from components.plan_training.component import plan_training
from components.prepare.component import prepare
from components.report.component import report
from components.score_teacher.component import score_teacher
from components.start_teacher_server.component import start_teacher_server
from components.stop_teacher_server.component import stop_teacher_server
from components.train.component import train
from components.validate_inputs.component import validate_inputs
from components.validate_tables.component import validate_tables

GPU = "nvidia.com/gpu"
TRAIN_WAIT = "1209600s"
"""How long a retried training launcher may keep reattaching (two weeks: longer than a job)."""
SMOKE_OPTIONS = {
    "teacher_tokenizer": "tiny:420",
    "student_tokenizer": "tiny:330",
    "teacher_shape": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
    "student_shape": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1},
    "corpus_bytes": 20000,
    "heldout_every": 5,
    "max_length": 64,
    "train": {
        "micro_batch_rows": 4,
        "lr": 0.003,
        "warmup_steps": 2,
        "loss": {"dynamic_kd_scale": True},
    },
    "token_budget": 1024,
}
"""The default ``options``: the CPU smoke run's shapes (never mutated)."""
SMOKE_SERVER = {"gpus": 0, "cpu": "2", "memory": "8Gi", "shm_size": "1Gi", "cache_size": "10Gi"}
"""``distill_served``'s default ``server``: one CPU replica for the smoke run (never mutated)."""
DESCRIPTION = (
    "Cross-tokenizer distillation (Common-Support Distillation): tables, data, "
    "teacher scoring, student training as a PyTorchJob or TrainJob, evaluation and report."
)


def _secrets(task: dsl.PipelineTask, secret: str) -> dsl.PipelineTask:
    """S3 credentials (and, when the Secret has them, endpoint and region) as env from the
    Secret ``secret``: never as parameters."""
    kubernetes.use_secret_as_env(
        task,
        secret_name=secret,
        secret_key_to_env={
            "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
        },
    )
    kubernetes.use_secret_as_env(
        task,
        secret_name=secret,
        optional=True,
        secret_key_to_env={
            "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
            "AWS_DEFAULT_REGION": "AWS_DEFAULT_REGION",
        },
    )
    return task


def _gpu(
    task: dsl.PipelineTask, gpus: int, node_selector: dict, tolerations: list
) -> dsl.PipelineTask:
    """A GPU step: ``gpus`` accelerators, the node selector and tolerations of parameters,
    ``/dev/shm`` in memory (NCCL, DataLoader workers), a one-day deadline."""
    task.set_accelerator_type(GPU).set_accelerator_limit(gpus)
    kubernetes.add_node_selector_json(task, node_selector)
    kubernetes.add_toleration_json(task, tolerations)
    kubernetes.empty_dir_mount(
        task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit="16Gi"
    )
    kubernetes.set_timeout(task, 24 * 3600)
    return task


def _monitored(task: dsl.PipelineTask, component: str) -> dsl.PipelineTask:
    """The pod labels the step PodMonitor selects (``manifests/monitoring``): KFP cannot
    declare a container port, so the PodMonitor scrapes the port number ``metrics_port``."""
    kubernetes.add_pod_label(task, "app.kubernetes.io/name", "crosskd")
    kubernetes.add_pod_label(task, "app.kubernetes.io/component", component)
    return task


def _cpu(
    task: dsl.PipelineTask, cpu: str, memory: str, *, cache: bool, retries: int = 0
) -> dsl.PipelineTask:
    task.set_cpu_request(cpu).set_memory_request(memory).set_caching_options(cache)
    if retries:
        task.set_retry(
            retries, backoff_duration="30s", backoff_factor=2.0, backoff_max_duration="3600s"
        )
    return task


def _prepare(
    p: dict,
) -> tuple[dsl.PipelineTask, PipelineChannel, dsl.PipelineTask, dsl.PipelineTask]:
    """validate_inputs -> init_student -> prepare, and per teacher: tables -> validate ->
    projection. Returns the validate_inputs task, the plan, the prepare task and the (looped)
    build_projection task."""
    secret = p["s3_secret"]
    inputs = validate_inputs(
        output_root=p["output_root"],
        teachers=p["teachers"],
        student=p["student"],
        train_data=p["train_data"],
        heldout_data=p["heldout_data"],
        ood_data=p["ood_data"],
        k=p["k"],
        tau=p["tau"],
        steps=p["steps"],
        compare_ce_only=p["compare_ce_only"],
        score_pods=p["score_pods"],
        options=p["options"],
        executor=p["executor"],
        job_kind=p["job_kind"],
        image=p["image"],
        gpus_per_node=p["gpus_per_node"],
        nodes=p["nodes"],
        job=p["job"],
    )
    _secrets(_cpu(inputs, "1", "4Gi", cache=False), secret)
    student = init_student(plan=inputs.outputs["plan"])
    _secrets(_cpu(student, "8", "32Gi", cache=True, retries=2), secret)
    plan = student.outputs["Output"]
    prepared = prepare(
        plan=plan, preparing=inputs.outputs["preparing"], metrics_port=p["metrics_port"]
    )
    _secrets(_cpu(prepared, "8", "32Gi", cache=True, retries=2), secret)
    _monitored(prepared, "prepare")
    pairs = plan_tables(plan=plan)
    _secrets(_cpu(pairs, "1", "1Gi", cache=True), secret)
    # kfp.local hands a loop body only its item and pipeline parameters: items are self-contained.
    with dsl.ParallelFor(pairs.output, name="teachers") as pair:
        built = build_tables(item=pair)
        _secrets(_cpu(built, "4", "16Gi", cache=True, retries=2), secret)
        checked = validate_tables(item=pair, tables=built.outputs["Output"])
        _secrets(_cpu(checked, "2", "8Gi", cache=True), secret)
        projected = build_projection(item=pair, tables=checked.outputs["Output"])
        _secrets(_cpu(projected, "2", "8Gi", cache=True), secret)
    return inputs, plan, prepared, projected


def _train(
    p: dict,
    inputs: dsl.PipelineTask,
    plan: PipelineChannel,
    prepared: dsl.PipelineTask,
    projected: dsl.PipelineTask,
    caches: PipelineChannel,
) -> dsl.PipelineTask:
    """plan_training on ``caches`` (merged caches, or the started servers), then per run (kd,
    ce): train as a PyTorchJob or a TrainJob (``job_kind``). Returns the (looped) train task."""
    runs = plan_training(
        run_config=inputs.outputs["run_config"],
        plan=plan,
        prepared=prepared.outputs["Output"],
        tables=dsl.Collected(projected.outputs["Output"]),
        caches=caches,
        run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    )
    _secrets(_cpu(runs, "1", "1Gi", cache=False), p["s3_secret"])
    with dsl.ParallelFor(runs.output, name="runs") as run:
        trained = train(
            item=run,
            executor=p["executor"],
            job_kind=p["job_kind"],
            image=p["image"],
            gpus_per_node=p["gpus_per_node"],
            nodes=p["nodes"],
            job=p["job"],
            s3_secret=p["s3_secret"],
            pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
        )
        # A CPU-only launcher: create or reattach to the job and wait for it.
        _secrets(_cpu(trained, "1", "2Gi", cache=False), p["s3_secret"])
        trained.set_retry(
            3, backoff_duration="60s", backoff_factor=2.0, backoff_max_duration=TRAIN_WAIT
        )
    return trained


def _report(
    p: dict,
    inputs: dsl.PipelineTask,
    plan: PipelineChannel,
    prepared: dsl.PipelineTask,
    trained: dsl.PipelineTask,
    after: dsl.PipelineTask | None = None,
) -> PipelineChannel:
    """evaluate (a GPU step; after ``after`` when given) -> report; returns the report's
    output."""
    evaluation = evaluate(
        plan=plan,
        prepared=prepared.outputs["Output"],
        runs=dsl.Collected(trained.outputs["Output"]),
        run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        scoring=inputs.outputs["scoring"],
        gpus=p["score_gpus"],
    )
    if after is not None:
        evaluation.after(after)
    _secrets(_cpu(evaluation, "8", "32Gi", cache=False), p["s3_secret"])
    _gpu(evaluation, p["score_gpus"], p["score_node_selector"], p["score_tolerations"])
    shown = report(
        plan=plan,
        evaluation=evaluation.outputs["Output"],
        runs=dsl.Collected(trained.outputs["Output"]),
        run_config=inputs.outputs["run_config"],
        run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    )
    _secrets(_cpu(shown, "1", "2Gi", cache=False, retries=2), p["s3_secret"])
    return shown.outputs["Output"]


def _stopper(p: dict) -> dsl.PipelineTask:
    """A stop_teacher_server task (CPU, no cache, retried: deleting is idempotent)."""
    stop = stop_teacher_server(
        teachers=p["teachers"], job=p["job"], pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER
    )
    return _cpu(stop, "1", "1Gi", cache=False, retries=2)


@dsl.pipeline(name="crosskd-distill", description=DESCRIPTION)
def distill(
    output_root: str = "s3://crosskd/distill",
    teachers: list = ["init"],  # noqa: B006 (a KFP default, never mutated)
    student: str = "init",
    train_data: str = "",
    heldout_data: str = "",
    ood_data: str = "",
    k: int = 16,
    tau: float = 1.0,
    steps: int = 12,
    compare_ce_only: bool = True,
    options: dict = SMOKE_OPTIONS,
    score_pods: int = 1,
    score_gpus: int = 0,
    score_node_selector: dict = {},  # noqa: B006
    score_tolerations: list = [],  # noqa: B006
    executor: str = "cluster",
    job_kind: str = "pytorchjob",
    image: str = "ghcr.io/crosskd/crosskd:0.1.0",
    gpus_per_node: int = 0,
    nodes: int = 1,
    job: dict = {"cpu": "2", "memory": "4Gi"},  # noqa: B006
    s3_secret: str = "crosskd-s3",
    metrics_port: int = 9400,
) -> dict:
    """One distillation run. ``steps``: the RunConfig's ``train.steps``; ``options``: any other
    RunConfig key (``docs/config.md``; its ``train`` mapping any other training key);
    ``job``: any other JobConfig key of the training job (tolerations, node selector,
    ...; its pods get ``s3_secret`` unless ``job`` names another); ``executor``: ``cluster`` (a
    job on the cluster), ``local`` (the local executor, this machine) or ``inprocess``;
    ``job_kind``: the cluster API the training job is for, ``pytorchjob`` (the Training
    Operator) or ``trainjob`` (Kubeflow Trainer v2, on the ``crosskd-torch`` TrainingRuntime of
    ``manifests/trainjob/runtime.yaml``, installed in the namespace); ``score_gpus``
    GPUs per scoring and evaluation pod (0: CPU; > 1: each teacher sharded over the pod's GPUs,
    :mod:`crosskd.teacher.sharded`); ``metrics_port``: the port the prepare and
    scoring pods serve ``/metrics`` on (the step PodMonitor of ``manifests/monitoring`` scrapes
    it; 0: a free port, -1: not served)."""
    p = dict(locals())  # the parameters, by name, for the stages both pipelines share
    inputs, plan, prepared, projected = _prepare(p)
    jobs = plan_scoring(
        plan=plan,
        prepared=prepared.outputs["Output"],
        scoring=inputs.outputs["scoring"],
        score_pods=score_pods,
    )
    _secrets(_cpu(jobs, "1", "1Gi", cache=True), s3_secret)
    with dsl.ParallelFor(jobs.output, name="scoring") as scoring_job:
        scored = score_teacher(job=scoring_job, gpus=score_gpus, metrics_port=metrics_port)
        _secrets(_cpu(scored, "8", "64Gi", cache=True), s3_secret)
        _monitored(scored, "score-teacher")
        _gpu(scored, score_gpus, score_node_selector, score_tolerations)
    merged = merge_cache(parts=dsl.Collected(scored.outputs["Output"]))
    _secrets(_cpu(merged, "2", "8Gi", cache=True, retries=2), s3_secret)
    trained = _train(p, inputs, plan, prepared, projected, merged.outputs["Output"])
    return _report(p, inputs, plan, prepared, trained)


@dsl.pipeline(
    name="crosskd-distill-served",
    description=DESCRIPTION.replace("teacher scoring", "teacher servers (crosskd serve)"),
)
def distill_served(
    output_root: str = "s3://crosskd/distill",
    teachers: list = ["init"],  # noqa: B006 (a KFP default, never mutated)
    student: str = "init",
    train_data: str = "",
    heldout_data: str = "",
    ood_data: str = "",
    k: int = 16,
    tau: float = 1.0,
    steps: int = 12,
    compare_ce_only: bool = True,
    options: dict = SMOKE_OPTIONS,
    score_pods: int = 1,
    score_gpus: int = 0,
    score_node_selector: dict = {},  # noqa: B006
    score_tolerations: list = [],  # noqa: B006
    executor: str = "cluster",
    job_kind: str = "pytorchjob",
    image: str = "ghcr.io/crosskd/crosskd:0.1.0",
    gpus_per_node: int = 0,
    nodes: int = 1,
    job: dict = {"cpu": "2", "memory": "4Gi"},  # noqa: B006
    s3_secret: str = "crosskd-s3",
    metrics_port: int = 9400,
    server: dict = SMOKE_SERVER,
) -> None:
    """``distill`` with a teacher server per teacher in place of the scored caches: the same
    parameters, and ``server``: the servers' ``crosskd.k8s.serve.TeacherServerConfig`` keys
    (``replicas``, ``gpus``, ``token_secret``, ...) plus ``serve`` (``crosskd serve`` keys),
    ``pod_monitor`` and ``ready_timeout_s`` (``docs/pipeline.md``). ``job`` must name the
    servers' token Secret as ``teacher_token_secret`` (unless ``server.serve.auth`` is
    ``none``); ``executor`` must be ``cluster``. No pipeline output (KFP takes none from inside
    an exit handler): the report is the ``report`` task's artifacts."""
    p = dict(locals())  # the parameters, by name, for the stages both pipelines share
    inputs, plan, prepared, projected = _prepare(p)
    # The exit task takes only pipeline parameters (KFP refuses other tasks' outputs there): the
    # servers' names derive from the run id and the teacher's index.
    stop_at_exit = _stopper(p)
    with dsl.ExitHandler(stop_at_exit, name="teacher-servers"):
        started = start_teacher_server(
            plan=plan,
            scoring=inputs.outputs["scoring"],
            server=server,
            job=job,
            executor=executor,
            image=image,
            pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        )
        # A CPU-only launcher that reattaches to its servers, so it may retry.
        _cpu(started, "1", "1Gi", cache=False)
        started.set_retry(
            2, backoff_duration="60s", backoff_factor=2.0, backoff_max_duration=TRAIN_WAIT
        )
        trained = _train(p, inputs, plan, prepared, projected, started.output)
        # Free the servers' GPUs before the evaluation asks for its own.
        stopped = _stopper(p).after(trained)
        _report(p, inputs, plan, prepared, trained, after=stopped)
