/* train - train a model on a stoke database, on the CPU or a GPU. A thin
 * main over stk_train_run(). */
#include "common/cli.h"
#include "trainer/trainer.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

static atomic_int stop_requested; /* lock-free, so a handler may set it */

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

static const char usage[] =
    "usage: train --db DB_DIR [options]\n"
    "Train a model on the train split of a stoke database, evaluating on the\n"
    "test split after every epoch.\n\n"
    "  --device cpu|cuda   where to train (default cpu); --gpu N picks the GPU\n"
    "  --model NAME|FILE   a built-in (cnn, mlp, resnet20, resnet18) or a model\n"
    "                      file (docs/models.md); default cnn\n"
    "  --epochs E          (default 10)      --batch B    (default 64)\n"
    "  --optim sgd|adamw   (default adamw)\n"
    "  --lr LR             (default: adamw 0.002, sgd 0.02)\n"
    "  --weight-decay W    (default: adamw 0.01, sgd 0)\n"
    "  --no-decay-norm-bias  weight decay on conv and linear weights only (not\n"
    "                      on biases and batchnorm weights)\n"
    "  --label-smoothing E cross-entropy with label smoothing E in [0, 1), as\n"
    "                      PyTorch's; also the test loss's (default 0)\n"
    "  --momentum M        (sgd; default 0.9) --nesterov\n"
    "  --clip NORM         scale gradients down to this global L2 norm\n"
    "  --schedule constant|step|cosine|linear|onecycle  (default cosine);\n"
    "                      onecycle: PyTorch's OneCycleLR, max_lr = --lr\n"
    "  --warmup STEPS      (default 100; not with onecycle, which rises over\n"
    "                      its first 30% of steps)\n"
    "  --step-size E --gamma G  the step schedule's epochs and factor\n"
    "  --workers N         loader threads (default 2)\n"
    "  --threads N         CPU compute threads (default: the CPUs usable)\n"
    "  --conv auto|im2col  3x3 stride-1 convolutions by Winograd F(2x2,3x3)\n"
    "                      (auto, default) or im2col + GEMM like the others\n"
    "  --augment [crop|rrc|none]  the training transform: crop = random crop\n"
    "                      (padding h/8) and horizontal flip (--augment alone);\n"
    "                      rrc = RandomResizedCrop + flip in the loader (the\n"
    "                      default on aspect-keeping databases); none\n"
    "  --crop-size N       side of the images the model sees (rrc, and the\n"
    "                      test split's centre crop); default: the stored side,\n"
    "                      or 0.875 of the shorter side on aspect-keeping DBs\n"
    "  --crop-ratio R      test split: resize the shorter side to N / R, then\n"
    "                      centre crop N (default 0.875 on aspect-keeping DBs,\n"
    "                      torchvision's 224/256)\n"
    "  --rrc-scale LO,HI   RandomResizedCrop's area range (default 0.08,1)\n"
    "  --no-dropout        dropout layers pass their input unchanged\n"
    "  --seed S            (default 1)\n"
    "  --out RUN_DIR       metrics.jsonl, curves.svg and checkpoints\n"
    "                      (default runs/train)\n"
    "  --resume auto|PATH  continue from the newest checkpoint or PATH\n"
    "  --init-from FILE    start from these safetensors weights\n"
    "  --evaluate          evaluate --init-from's weights on the test split;\n"
    "                      nothing is trained or written\n"
    "  --log-every N       steps between metric lines (default 50)\n"
    "  --keep K            checkpoints kept besides the best (default 3)\n"
    "  --max-steps N       stop after N steps\n"
    "  --accum K           micro-batches of --batch per optimizer step (default 1)\n"
    "  --quiet             no progress output\n"
    "\nData parallel (one process per rank, docs/distributed.md):\n"
    "  --nproc N           N ranks on this machine (--device cpu: shared memory)\n"
    "  --gpus N|I,J,...    one rank per GPU: the first N, or these (implies cuda)\n"
    "  --nnodes K --node-rank R   K machines, this one R (0 serves the store)\n"
    "  --master-addr HOST  node 0's address (default 127.0.0.1)\n"
    "  --master-port P     the store's port (default: a free one on one node)\n"
    "  --log-all-ranks     relay every rank's output, not only rank 0's\n"
    "  --bucket-mb MB      DDP gradient bucket size (default 25)\n"
    "  --sync-bn           batchnorm statistics over all ranks (SyncBatchNorm)\n"
    "  --bind cpus|none    CPU ranks on disjoint CPUs of this machine (default\n"
    "                      cpus, where their threads fit) or wherever the OS\n"
    "                      runs them\n"
    "  --timeout S         give up waiting for other ranks after S seconds (300)\n";

static int num_i(const char *flag, const char *s, long lo, long hi, int *out)
{
    return stk_cli_int("train", flag, s, lo, hi, out);
}

static int num_f(const char *flag, const char *s, double lo, double hi,
                 float *out)
{
    return stk_cli_float("train", flag, s, lo, hi, out);
}

static int choose(const char *flag, const char *s, const char *const *names,
                  int n, int *out)
{
    return stk_cli_choice("train", flag, s, names, n, out);
}

/* --augment, --augment=KIND or --augment KIND: the bare flag is the crop
 * it always was, a following word names the transform. */
static int parse_augment(int argc, char **argv, stk_augment *out)
{
    static const char *const kinds[] = {"crop", "rrc", "none"};
    static const stk_augment values[] = {STK_AUG_CROP, STK_AUG_RRC, STK_AUG_NONE};
    const char *arg = optarg;
    if (!arg && optind < argc && argv[optind][0] != '-')
        arg = argv[optind++];
    int v = 0;
    if (arg && choose("--augment", arg, kinds, 3, &v))
        return -1;
    *out = values[v];
    return 0;
}

/* --rrc-scale LO,HI: 0 < LO <= HI <= 1. */
static int parse_scale(const char *s, double scale[2])
{
    char *end;
    double lo = strtod(s, &end), hi = *end == ',' ? strtod(end + 1, &end) : -1;
    if (*end || !(lo > 0 && lo <= hi && hi <= 1)) {
        fprintf(stderr, "train: --rrc-scale: expected LO,HI with 0 < LO <= HI <= 1 "
                        "(e.g. 0.08,1), got '%s'\n", s);
        return -1;
    }
    scale[0] = lo; /* kept in double: 0.08 draws as the default does */
    scale[1] = hi;
    return 0;
}

/* The launcher's side of the command line. */
typedef struct dist_opts {
    int nproc, ngpus, gpus[64], nnodes, node_rank, master_port;
    const char *master_addr;
    bool log_all_ranks, gpus_given, no_bind;
    char gpus_arg[64]; /* --gpus as given, for messages */
} dist_opts;

/* --gpus N (the first N) or a list I,J,... of device ids. */
static int parse_gpus(const char *s, dist_opts *d)
{
    d->gpus_given = true;
    snprintf(d->gpus_arg, sizeof d->gpus_arg, "%s", s);
    if (!strchr(s, ',')) {
        int n;
        if (num_i("--gpus", s, 1, 64, &n))
            return -1;
        d->ngpus = n;
        for (int i = 0; i < n; i++)
            d->gpus[i] = i;
        return 0;
    }
    if (stk_cli_int_list("train", "--gpus", s, 0, 1023, d->gpus, 64,
                         &d->ngpus))
        return -1;
    for (int j = 1; j < d->ngpus; j++)
        for (int i = 0; i < j; i++)
            if (d->gpus[i] == d->gpus[j]) {
                fprintf(stderr, "train: --gpus %s names GPU %d twice\n", s, d->gpus[i]);
                return -1;
            }
    return 0;
}

static int parse(int argc, char **argv, stk_train_opts *o, dist_opts *d)
{
    enum { O_NEST = 256, O_WD, O_CLIP, O_SCHED, O_WARM, O_SS, O_GAMMA,
           O_THREADS, O_AUG, O_NODROP, O_RESUME, O_INIT, O_LOG, O_KEEP,
           O_MAX, O_QUIET, O_GPU, O_ACCUM, O_NPROC, O_GPUS, O_NNODES,
           O_NODE, O_MADDR, O_MPORT, O_LOGALL, O_BUCKET, O_TIMEOUT, O_CONV, O_BIND, O_SYNCBN, O_EVAL,
           O_SMOOTH, O_NODECAY, O_CROP, O_CRATIO, O_RRCSCALE };
    static const struct option longs[] = {
        {"db", 1, 0, 'd'}, {"device", 1, 0, 'D'}, {"model", 1, 0, 'm'},
        {"epochs", 1, 0, 'e'}, {"batch", 1, 0, 'b'}, {"lr", 1, 0, 'l'},
        {"optim", 1, 0, 'o'}, {"momentum", 1, 0, 'M'}, {"workers", 1, 0, 'w'},
        {"seed", 1, 0, 's'}, {"out", 1, 0, 'O'}, {"nesterov", 0, 0, O_NEST},
        {"weight-decay", 1, 0, O_WD}, {"clip", 1, 0, O_CLIP},
        {"schedule", 1, 0, O_SCHED}, {"warmup", 1, 0, O_WARM},
        {"step-size", 1, 0, O_SS}, {"gamma", 1, 0, O_GAMMA},
        {"threads", 1, 0, O_THREADS}, {"augment", 2, 0, O_AUG},
        {"no-dropout", 0, 0, O_NODROP}, {"resume", 1, 0, O_RESUME},
        {"init-from", 1, 0, O_INIT}, {"log-every", 1, 0, O_LOG},
        {"keep", 1, 0, O_KEEP}, {"max-steps", 1, 0, O_MAX},
        {"quiet", 0, 0, O_QUIET}, {"gpu", 1, 0, O_GPU},
        {"accum", 1, 0, O_ACCUM}, {"nproc", 1, 0, O_NPROC},
        {"gpus", 1, 0, O_GPUS}, {"nnodes", 1, 0, O_NNODES},
        {"node-rank", 1, 0, O_NODE}, {"master-addr", 1, 0, O_MADDR},
        {"master-port", 1, 0, O_MPORT}, {"log-all-ranks", 0, 0, O_LOGALL},
        {"bucket-mb", 1, 0, O_BUCKET}, {"timeout", 1, 0, O_TIMEOUT},
        {"conv", 1, 0, O_CONV}, {"bind", 1, 0, O_BIND},
        {"label-smoothing", 1, 0, O_SMOOTH}, {"no-decay-norm-bias", 0, 0, O_NODECAY},
        {"sync-bn", 0, 0, O_SYNCBN}, {"evaluate", 0, 0, O_EVAL}, {"crop-size", 1, 0, O_CROP},
        {"crop-ratio", 1, 0, O_CRATIO}, {"rrc-scale", 1, 0, O_RRCSCALE},
        {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    static const char *const devices[] = {"cpu", "cuda"};
    static const char *const binds[] = {"cpus", "none"};
    int ch, rc = 0, v;
    bool warmup_given = false, sgd_given = false, step_given = false,
         gpu_given = false;
    opterr = 0;
    while (!rc && (ch = getopt_long(argc, argv, ":h", longs, NULL)) != -1) {
        switch (ch) {
        case 'd': o->db = optarg; break;
        case 'D': rc = choose("--device", optarg, devices, 2, &v); o->device = (stk_device_kind)v; break;
        case 'm': o->model = optarg; break;
        case 'e': rc = num_i("--epochs", optarg, 1, 100000, &o->epochs); break;
        case 'b': rc = num_i("--batch", optarg, 1, 1 << 16, &o->batch); break;
        case 'l': rc = num_f("--lr", optarg, 0, 100, &o->lr); break;
        case 'o': rc = choose("--optim", optarg, stk_optim_names, 2, &v); o->optim = (stk_optim)v; break;
        case 'M': rc = num_f("--momentum", optarg, 0, 0.9999, &o->momentum); sgd_given = true; break;
        case 'w': rc = num_i("--workers", optarg, 0, 64, &o->workers); break;
        case 's': rc = stk_cli_u64("train", "--seed", optarg, &o->seed); break;
        case 'O': o->out = optarg; break;
        case O_NEST: o->nesterov = sgd_given = true; break;
        case O_WD: rc = num_f("--weight-decay", optarg, 0, 10, &o->weight_decay); break;
        case O_CLIP: rc = num_f("--clip", optarg, 0, 1e9, &o->clip); break;
        case O_SCHED: rc = choose("--schedule", optarg, stk_sched_names, 5, &v); o->sched = (stk_sched)v; break;
        case O_WARM: rc = num_i("--warmup", optarg, 0, 1 << 30, &o->warmup); warmup_given = true; break;
        case O_SS: rc = num_i("--step-size", optarg, 1, 100000, &o->step_size); step_given = true; break;
        case O_GAMMA: rc = num_f("--gamma", optarg, 0, 1, &o->gamma); step_given = true; break;
        case O_THREADS: rc = num_i("--threads", optarg, 0, 1024, &o->threads); break;
        case O_AUG: rc = parse_augment(argc, argv, &o->augment); break;
        case O_CROP: rc = num_i("--crop-size", optarg, 1, 4096, &o->crop_size); break;
        case O_CRATIO: rc = num_f("--crop-ratio", optarg, 0.01, 1, &o->crop_ratio); break;
        case O_RRCSCALE: rc = parse_scale(optarg, o->rrc_scale); break;
        case O_NODROP: o->dropout = false; break;
        case O_RESUME: o->resume = optarg; break;
        case O_INIT: o->init_from = optarg; break;
        case O_LOG: rc = num_i("--log-every", optarg, 1, 1 << 30, &o->log_every); break;
        case O_KEEP: rc = num_i("--keep", optarg, 1, 1000, &o->keep); break;
        case O_MAX: rc = num_i("--max-steps", optarg, 1, 1 << 30, &o->max_steps); break;
        case O_QUIET: o->quiet = true; break;
        case O_GPU: rc = num_i("--gpu", optarg, 0, 1023, &o->device_id); gpu_given = true; break;
        case O_ACCUM: rc = num_i("--accum", optarg, 1, 1 << 16, &o->accum); break;
        case O_NPROC: rc = num_i("--nproc", optarg, 1, 64, &d->nproc); break;
        case O_GPUS: rc = parse_gpus(optarg, d); break;
        case O_NNODES: rc = num_i("--nnodes", optarg, 1, 1 << 16, &d->nnodes); break;
        case O_NODE: rc = num_i("--node-rank", optarg, 0, 1 << 16, &d->node_rank); break;
        case O_MADDR: d->master_addr = optarg; break;
        case O_MPORT: rc = num_i("--master-port", optarg, 0, 65535, &d->master_port); break;
        case O_LOGALL: d->log_all_ranks = true; break;
        case O_BUCKET: rc = num_f("--bucket-mb", optarg, 0.001, 4096, &o->bucket_mb); break;
        case O_TIMEOUT: rc = num_i("--timeout", optarg, 1, 1 << 20, &o->timeout_s); break;
        case O_CONV: rc = choose("--conv", optarg, stk_conv_names, 2, &v); o->conv = (stk_conv_algo)v; break;
        case O_BIND: rc = choose("--bind", optarg, binds, 2, &v); d->no_bind = v == 1; break;
        case O_SMOOTH: rc = num_f("--label-smoothing", optarg, 0, 1, &o->label_smoothing); break;
        case O_NODECAY: o->no_decay_norm_bias = true; break;
        case O_SYNCBN: o->sync_bn = true; break;
        case O_EVAL: o->evaluate = true; break;
        case 'h': fputs(usage, stdout); exit(0);
        case ':': fprintf(stderr, "train: %s needs a value\n", argv[optind - 1]); return -1;
        default:
            fprintf(stderr, "train: unknown option '%s' (see train --help)\n", argv[optind - 1]);
            return -1;
        }
    }
    if (!rc && (optind != argc || !o->db)) {
        fprintf(stderr, "train: --db DB_DIR is required and takes no other arguments (see train --help)\n");
        return -1;
    }
    /* a flag the run would silently ignore is a mistake worth saying (a
     * ResNet recipe's --momentum under the default AdamW, say) */
    const char *ignored = NULL;
    if (warmup_given && o->sched == STK_SCHED_ONECYCLE)
        ignored = "--warmup does not apply to --schedule onecycle, which rises "
                  "over its first 30% of steps (OneCycleLR's pct_start 0.3)";
    else if (sgd_given && o->optim != STK_OPT_SGD)
        ignored = "--momentum and --nesterov apply to --optim sgd; this run's "
                  "optimizer is adamw (the default), whose momentum is its betas";
    else if (step_given && o->sched != STK_SCHED_STEP)
        ignored = "--step-size and --gamma apply to --schedule step (StepLR)";
    else if (gpu_given && (d->gpus_given || d->nproc > 1 || d->nnodes > 1))
        ignored = "--gpu does not apply to data-parallel ranks, which take "
                  "cuda:LOCAL_RANK or the GPUs --gpus names (--gpus 2, "
                  "--gpus 1,3)";
    else if (gpu_given && o->device != STK_DEV_CUDA)
        ignored = "--gpu N picks the GPU of --device cuda; this run is on the CPU "
                  "(--gpus runs one rank per GPU)";
    if (!rc && ignored) {
        fprintf(stderr, "train: %s\n", ignored);
        return -1;
    }
    stk_err err;
    if (!rc && stk_train_check_opts(o, &err)) { /* flags that disagree */
        fprintf(stderr, "train: %s\n", err.msg);
        return -1;
    }
    return rc;
}

/* --gpus means CUDA with one rank per listed GPU; --nproc must agree. */
static int check_dist(stk_train_opts *o, dist_opts *d)
{
    if (d->gpus_given) {
        if (d->nproc && d->nproc != d->ngpus) {
            fprintf(stderr, "train: --nproc %d disagrees with --gpus (%d GPUs)\n",
                    d->nproc, d->ngpus);
            return -1;
        }
        d->nproc = d->ngpus;
        o->device = STK_DEV_CUDA;
    }
    if (d->node_rank < 0) { /* srun with one launcher per node: its node id */
        const char *id = getenv("SLURM_NODEID");
        d->node_rank = id && d->nnodes > 1 ? atoi(id) : 0;
    }
    if (d->node_rank >= d->nnodes) {
        fprintf(stderr, "train: --node-rank %d must be below --nnodes %d\n",
                d->node_rank, d->nnodes);
        return -1;
    }
    return 0;
}

/* --gpus against the GPUs this node's launcher sees, before any rank
 * starts: two ranks on one GPU would otherwise fail inside NCCL ("Duplicate
 * GPU"), after the rendezvous. */
static int check_gpus(const dist_opts *d)
{
    int count = 0;
    stk_err e = {0};
    if (stk_cuda_device_count(&count, &e)) {
        fprintf(stderr, e.code == STK_ENODEV ? "train: --gpus %s: no GPU here (%s)\n"
                                             : "train: --gpus %s: %s\n",
                d->gpus_arg, e.msg);
        return -1;
    }
    for (int i = 0; i < d->ngpus; i++) {
        if (d->gpus[i] < count)
            continue;
        if (strchr(d->gpus_arg, ','))
            fprintf(stderr, "train: --gpus %s: GPU %d is not visible (%d GPU(s) "
                            "visible: 0..%d)\n", d->gpus_arg, d->gpus[i], count,
                    count - 1);
        else
            fprintf(stderr, "train: --gpus %s: %d ranks, %d GPU(s) visible\n",
                    d->gpus_arg, d->ngpus, count);
        return -1;
    }
    return 0;
}

/* A CUDA rank's GPU without --gpus: cuda:LOCAL_RANK as torchrun's, or the
 * one GPU it sees where the launcher bound one per task (srun
 * --gpus-per-task=1 sets CUDA_VISIBLE_DEVICES); never a GPU another local
 * rank may take. */
static int rank_gpu(const stk_rank_info *ri, int *device)
{
    int count = 0;
    stk_err e = {0};
    if (stk_cuda_device_count(&count, &e)) {
        fprintf(stderr, "train: rank %d: %s\n", ri->rank, e.msg);
        return -1;
    }
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    if (count >= ri->local_world)
        *device = ri->local_rank;
    else if (count == 1 && visible && *visible && !strchr(visible, ','))
        *device = 0;
    else {
        fprintf(stderr, "train: rank %d: %d ranks on this node, %d GPU(s) visible; "
                        "one GPU per rank (start fewer ranks, or bind one GPU per "
                        "task: srun --gpus-per-task=1)\n",
                ri->rank, ri->local_world, count);
        return -1;
    }
    return 0;
}

/* This rank's device and threads, from its place on the node. */
static int place_rank(stk_train_opts *o, const dist_opts *d,
                      const stk_rank_info *ri)
{
    if (d->gpus_given) {
        if (ri->local_rank >= d->ngpus) {
            fprintf(stderr, "train: rank %d is local rank %d, but --gpus lists %d "
                            "GPU(s)\n", ri->rank, ri->local_rank, d->ngpus);
            return -1;
        }
        o->device_id = d->gpus[ri->local_rank];
    } else if (o->device == STK_DEV_CUDA && ri->world > 1 &&
               rank_gpu(ri, &o->device_id))
        return -1;
    const char *lp = getenv("STOKE_LAUNCHER_PID");
    if (o->device == STK_DEV_CPU && !o->threads && ri->local_world > 1) {
        int cpus = stk_usable_cpus(); /* shared between this machine's ranks */
        /* srun -c N gave this task N CPUs of its own: use them all */
        const char *cpt = getenv("SLURM_CPUS_PER_TASK");
        int per_task = !lp && !strcmp(ri->source, "SLURM") && cpt ? atoi(cpt) : 0;
        if (per_task > 0)
            o->threads = per_task < cpus ? per_task : cpus;
        else
            o->threads = cpus / ri->local_world > 0 ? cpus / ri->local_world : 1;
    }
    /* started by a launcher: die with it, never outlive it */
    if (lp) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != (pid_t)atol(lp))
            return -1; /* it is already gone */
    }
    /* the launcher's CPU ranks share its CPUs out; ranks srun started
     * are placed by srun's own --cpu-bind */
    stk_err e;
    if (lp && o->device == STK_DEV_CPU && !d->no_bind &&
        stk_rank_bind_cpus(ri, o->threads, &e) < 0) /* a note; it still runs */
        fprintf(stderr, "train: %s; running unbound\n", e.msg);
    return 0;
}

static int launch(const stk_train_opts *o, const dist_opts *d, char **argv)
{
    stk_launch_opts lo = {.nproc = d->nproc ? d->nproc : 1,
                          .gpus = d->gpus_given ? d->gpus : NULL,
                          .nnodes = d->nnodes,
                          .node_rank = d->node_rank,
                          .master_addr = d->master_addr,
                          .master_port = d->master_port,
                          .log_all_ranks = d->log_all_ranks,
                          .timeout_ms = o->timeout_s * 1000,
                          .argv = argv};
    int code;
    stk_err err = {0};
    if (stk_launch(&lo, &code, &err)) {
        fprintf(stderr, "train: error: %s\n", err.msg);
        return code ? code : 1;
    }
    return code;
}

int main(int argc, char **argv)
{
    stk_train_opts o;
    stk_train_defaults(&o);
    o.stop = &stop_requested;
    dist_opts d = {.nnodes = 1, .node_rank = -1};
    if (parse(argc, argv, &o, &d) || check_dist(&o, &d))
        return 2;
    /* launcher flags start a launcher, also inside a SLURM step (one srun
     * task per node); RANK (set by a launcher) makes a rank */
    bool launcher_flags = d.nproc || d.gpus_given || d.nnodes > 1;
    const char *rank = getenv("RANK");
    if (rank && !*rank)
        rank = NULL; /* set but empty: unset, as the rank variables read it */
    if ((d.nnodes > 1 || (d.nproc && !d.gpus_given)) && rank &&
        !getenv("STOKE_LAUNCHER_PID")) {
        /* RANK from another launcher (torchrun) or left in the shell: the
         * flags would be ignored, this process one rank of that job (--gpus
         * I,J still maps its LOCAL_RANK to a GPU) */
        fprintf(stderr, "train: RANK=%s is set (by torchrun, or left in this "
                        "shell), so this process is one rank of that job and "
                        "--nproc/--nnodes would be ignored: unset RANK and "
                        "WORLD_SIZE to start the ranks here, or leave those "
                        "flags out\n", rank);
        return 2;
    }
    stk_rank_info ri;
    stk_err err = {0};
    if (stk_rank_from_env(&ri, &err)) {
        fprintf(stderr, "train: error: %s\n", err.msg);
        return 2;
    }
    if (!rank && launcher_flags)
        return d.gpus_given && check_gpus(&d) ? 2 : launch(&o, &d, argv);
    bool is_rank = rank || ri.world > 1;
    if (is_rank && place_rank(&o, &d, &ri))
        return 2;
    o.rank = &ri;
    /* a run stops at a step boundary with a checkpoint; --evaluate writes
     * nothing, so a signal ends it at once (exit 130 by SIGINT) */
    struct sigaction sa = {0};
    sa.sa_handler = o.evaluate ? SIG_DFL : on_signal;
    sa.sa_flags = SA_RESTART; /* system calls go on; the flag is polled */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    stk_train_result res;
    int rc = stk_train_run(&o, &res, &err);
    if (rc) {
        fprintf(stderr, "train: error: %s\n", err.msg);
        return 1;
    }
    if (ri.rank != 0)
        return res.stopped && stop_requested ? 130 : 0;
    if (res.evaluated) {
        printf("train: %s on %s's %s split: test accuracy %.2f%%, test loss "
               "%.4f\n",
               o.init_from, o.db, res.eval_split, 100 * res.test_acc,
               res.test_loss);
        return 0;
    }
    if (res.stopped) {
        fprintf(stderr, "train: stopped at step %llu; the checkpoint in %s/checkpoints "
                        "continues it with --resume auto\n",
                (unsigned long long)res.steps, o.out);
        return stop_requested ? 130 : 0;
    }
    if (res.at_max_steps) {
        printf("train: %s is at step %llu, --max-steps %d: nothing left to "
               "train (a larger --max-steps, or none, continues it)\n",
               o.out, (unsigned long long)res.steps, o.max_steps);
        return 0;
    }
    if (!res.epochs_done) { /* resumed a run that had already finished */
        printf("train: %s already finished %d epoch(s) (%llu steps, best test accuracy "
               "%.2f%%); nothing left to train\n",
               o.out, o.epochs, (unsigned long long)res.steps, 100 * res.best_acc);
        return 0;
    }
    printf("train: %d epoch(s), %llu steps: test accuracy %.2f%% (best %.2f%%), test loss %.4f\n",
           res.epochs_done, (unsigned long long)res.steps, 100 * res.test_acc,
           100 * res.best_acc, res.test_loss);
    return 0;
}
