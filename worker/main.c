/* main.c - stepd-worker: argv, logging, signals; worker_run() does the rest. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "backend.h"
#include "file.h"
#include "cli.h"
#include "log.h"
#include "specconf.h"
#include "stepd-config.h"
#include "worker.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: stepd-worker (--coordinator ADDR | --rendezvous-dir DIR) --group G --rank R\n"
        "                    --world-size N [--device cpu|cuda:I] (--model DIR | --mock)\n"
        "                    [--mtp-model DIR] [--mtp K | --speculative-config JSON]\n"
        "                    [--threads T] [--exact]\n"
        "                    [--max-seqs|--max-num-seqs S] [--max-batched-tokens T]\n"
        "                    [--max-model-len L [--allow-long-max-model-len]]\n"
        "                    [--kv-cache-memory BYTES] [--gpu-memory-utilization F]\n"
        "                    [--kv-cache-dtype auto|bf16|fp32] [--kv-blocks B] [--block-size BS]\n"
        "                    [--no-enable-prefix-caching] [--prefix-cache-salt S]\n"
        "                    [--rendezvous-timeout MS] [--collective-timeout MS] [--load-timeout MS]\n"
        "                    [--report FILE] [--engine-listen ADDR] [--control-key-file FILE]\n"
        "                    [--insecure-control] [--comm-net-devices DEVS]\n"
        "                    [--control-tls-ca FILE [--control-tls-cert FILE --control-tls-key FILE]]\n"
        "                    [--max-waiting N] [--logprobs-mode raw_logprobs|processed_logprobs]\n"
        "  rank 0 offline drivers (tests): --generate FILE [--max-tokens N] [--output FILE]\n"
        "                                  --dump-logits FILE --prompt-ids 1,2,3\n"
        "                                  --step-delay MS\n"
        "  --coordinator ADDR      control service of the stepd coordinator (host:port, unix:path)\n"
        "  --rendezvous-dir DIR    file rendezvous in a directory shared by the ranks\n"
        "  --world-size N          1, 2, 4 or 8 ranks in the group\n"
        "  --mtp K                 MTP speculative tokens on rank 0 (0..3): the most per step\n"
        "  --speculative-config J  as vLLM: '{\"method\":\"mtp\",\"num_speculative_tokens\":K}'\n"
        "                          (without num_speculative_tokens: the checkpoint's MTP layers, up to 3;\n"
        "                          \"model\": DIR, the MTP layers from DIR as --mtp-model)\n"
        "                          (+ \"draft_quantization\": \"auto\" (default: MXFP4 copies of\n"
        "                          the MTP weights on CPU, the checkpoint's on CUDA), \"none\", \"mxfp4\";\n"
        "                          \"draft_policy\": \"adaptive\" (default: 0..K drafts per step,\n"
        "                          whatever measures fastest) or \"fixed\" (always K);\n"
        "                          \"draft_vocab\": N (a multiple of 64: drafts score only the N\n"
        "                          tokens this worker has emitted most often; default 0, all))\n"
        "  --max-model-len L       longest sequence (default 1024); above the model's\n"
        "                          max_position_embeddings refused unless --allow-long-max-model-len\n"
        "  --kv-cache-memory BYTES KV cache per rank, e.g. 8GiB (default: on CPU every sequence at\n"
        "                          --max-model-len, at most 90%% of the available memory; on a GPU\n"
        "                          --gpu-memory-utilization of it after weights and activations)\n"
        "  --gpu-memory-utilization F  share of a GPU's memory for the worker (default 0.9)\n"
        "  --kv-cache-dtype D      auto or bf16 (default; FP32 accumulation), fp32\n"
        "  --kv-blocks B           full-attention pool blocks, overriding the budget (the\n"
        "                          sliding-window pool is sized by the window either way)\n"
        "  --no-enable-prefix-caching  recompute every prompt (--enable-prefix-caching, the\n"
        "                          default: reuse cached KV blocks)\n"
        "  --prefix-cache-salt S   deployment salt of the prefix-cache keys (default: random)\n"
        "  --collective-timeout MS deadline of every collective (default 30000)\n"
        "  --rendezvous-timeout MS how long to wait for the other ranks (default 60000)\n"
        "  --load-timeout MS       how long ranks wait for each other to load (default 1800000)\n"
        "  --engine-listen ADDR    rank 0: stepd.v1.Engine address registered with the\n"
        "                          coordinator (default 127.0.0.1:20061; unix:/path allowed)\n"
        "  --control-key-file FILE the cluster key (or $STEPD_CONTROL_KEY): sent to the control\n"
        "                          service, and required by rank 0's engine service from its\n"
        "                          callers; needed to register or serve the engine\n"
        "  --insecure-control      no key: register and serve the engine without authentication\n"
        "  --comm-net-devices DEVS network devices the group's UCX transports bind, as\n"
        "                          UCX_NET_DEVICES (\"eth0\", \"mlx5_0:1,eth0\"; default: loopback\n"
        "                          only, lo, unless $UCX_NET_DEVICES says otherwise)\n"
        "  --control-tls-ca FILE   dial the control service over TLS, verifying it with this CA\n"
        "                          (--control-tls-cert/--control-tls-key: a client certificate)\n"
        "  --max-waiting N         rank 0: requests the engine queues beyond --max-seqs (default:\n"
        "                          the KV pool's block count, within 64..4096); the engine admits\n"
        "                          --max-seqs + N at once and tells the coordinator so\n"
        "  --logprobs-mode M       what logprobs report: raw_logprobs (default: the model's\n"
        "                          distribution, before any sampling transform) or\n"
        "                          processed_logprobs (after penalties, temperature, top-k/p)\n"
        "  --insecure-listen       allow a non-loopback --engine-listen (it has no authentication)\n"
        "  --health-listen ADDR    HTTP probes: GET /livez (alive), GET /readyz (loaded, group formed)\n"
        "  --version, --help       print the version, or this text, and exit\n"
        "  --check-device DEV      open the backend of DEV (cpu, cuda:N) and exit: 0 when this\n"
        "                          machine has it, 2 with the reason (`stepd serve` asks first)\n"
        "Exit status: 0 ok, 1 failure, 2 usage, 3 rendezvous, 4 collective failed (peer gone).\n");
}

static int parse_int(const char *s, const char *flag, int lo, int hi, int *ret)
{
    struct err_buf e;
    int r = cli_parse_int(flag, s, lo, hi, ret, &e);

    if (r < 0)
        fprintf(stderr, "stepd-worker: %s\n", e.msg);
    return r;
}

static int parse_bytes(const char *s, const char *flag, int64_t *ret)
{
    struct err_buf e;
    int r = cli_parse_bytes(flag, s, 1, INT64_MAX / 2, ret, &e);

    if (r < 0)
        fprintf(stderr, "stepd-worker: %s\n", e.msg);
    return r;
}

static int parse_fraction(const char *s, const char *flag, double *ret)
{
    struct err_buf e;
    int r = cli_parse_fraction(flag, s, 0.0, 1.0, ret, &e);

    if (r < 0)
        fprintf(stderr, "stepd-worker: %s\n", e.msg);
    return r;
}

static int parse_kv_dtype(const char *s, bool *ret_f32)
{
    struct err_buf e;
    int r = cli_parse_kv_dtype("--kv-cache-dtype", s, ret_f32, &e);

    if (r < 0)
        fprintf(stderr, "stepd-worker: %s\n", e.msg);
    return r;
}

/* --speculative-config JSON (vLLM's spelling): the one parser (common/specconf.c). */
static int parse_spec(const char *json, struct spec_config *ret)
{
    struct err_buf e;
    int r = spec_config_parse(json, ret, &e);

    if (r < 0)
        fprintf(stderr, "stepd-worker: %s\n", e.msg);
    return r;
}

/* --mtp K: num_speculative_tokens of the speculative config, checked where every K is. */
static int parse_mtp(const char *s, struct spec_config *spec)
{
    struct err_buf e;
    int k, r = cli_parse_int("--mtp", s, INT_MIN, INT_MAX, &k, &e);

    if (r == 0)
        r = spec_k_check("--mtp", k, false, &e);
    if (r < 0)
        fprintf(stderr, "stepd-worker: %s\n", e.msg);
    else
        spec->num_speculative_tokens = k;
    return r;
}

/* --check-device DEV: can this machine run a rank on DEV?  What `stepd serve` asks before it
 * starts any rank, so that a device that is not there ends it at once with the reason. */
static int check_device(const char *dev)
{
    struct backend_cfg bc = { .n_threads = 1 };
    struct backend *be = NULL;
    const char *name = "cpu";
    int r;

    if (strncmp(dev, "cuda:", 5) == 0) {
        name = "cuda";
        bc.device = atoi(dev + 5);
    } else if (strcmp(dev, "cpu") != 0) {
        fprintf(stderr, "stepd-worker: --check-device '%s': expected cpu or cuda:N\n", dev);
        return WORKER_EXIT_USAGE;
    }
    r = backend_new(name, &bc, &be);
    if (r < 0) {
        printf("%s: %s\n", dev, r == -ENODEV ? (strcmp(name, "cuda") == 0 ?
               "no CUDA device or no CUDA plugin (libstepd-cuda.so) on this machine" : "not available") :
               strerror(-r));
        return WORKER_EXIT_USAGE;
    }
    backend_free(be);
    printf("%s: available\n", dev);
    return WORKER_EXIT_OK;
}

/* Started by `stepd serve` ($STEPD_SUPERVISOR_PID is its pid): end with it.  A rank outlives
 * a lost coordinator otherwise (it waits to register again), which is right under systemd or
 * Kubernetes but would leave a dead `stepd serve`'s ranks running.  SIGTERM, so that a rank
 * still stops as on any other termination. */
static int supervised_by_parent(void)
{
    const char *s = getenv("STEPD_SUPERVISOR_PID");
    char *end;
    long pid;

    if (!s || !*s)
        return 0;
    pid = strtol(s, &end, 10);
    unsetenv("STEPD_SUPERVISOR_PID");
    if (*end || pid <= 1) {
        log_error("STEPD_SUPERVISOR_PID '%s': expected a process id", s);
        return -EINVAL;
    }
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0) {
        log_error("prctl(PR_SET_PDEATHSIG): %s", strerror(errno));
        return -errno;
    }
    if (getppid() != (pid_t)pid) {
        log_error("the supervisor (pid %ld) is gone before this rank started", pid);
        return -ESRCH;
    }
    return 0;
}

int main(int argc, char **argv)
{
    enum {
        O_COORD = 256, O_RDV, O_GROUP, O_RANK, O_WORLD, O_DEVICE, O_MODEL, O_MTP_MODEL, O_MTP,
        O_THREADS, O_EXACT, O_MOCK, O_MAX_SEQS, O_MAX_BT, O_MAX_LEN, O_KV, O_BS, O_RDV_TO,
        O_COLL_TO, O_GEN, O_MAX_TOK, O_OUT, O_LOGITS, O_PROMPT, O_DELAY, O_REPORT, O_ENGINE, O_CKEY, O_LOAD_TO, O_SPEC, O_INSECURE, O_HEALTH, O_HELP,
        O_KV_MEM, O_GPU_UTIL, O_KV_DTYPE, O_PREFIX_ON, O_PREFIX_OFF, O_PREFIX_SALT,
        O_TLS_CA, O_TLS_CERT, O_TLS_KEY, O_MAX_WAIT, O_LP_MODE, O_INSECURE_CTL, O_NET_DEVS, O_VERSION, O_CHECK_DEV, O_ALLOW_LONG,
    };
    static const struct option opts[] = {
        { "coordinator", required_argument, NULL, O_COORD },
        { "rendezvous-dir", required_argument, NULL, O_RDV },
        { "group", required_argument, NULL, O_GROUP },
        { "rank", required_argument, NULL, O_RANK },
        { "world-size", required_argument, NULL, O_WORLD },
        { "device", required_argument, NULL, O_DEVICE },
        { "model", required_argument, NULL, O_MODEL },
        { "mtp-model", required_argument, NULL, O_MTP_MODEL },
        { "mtp", required_argument, NULL, O_MTP },
        { "speculative-config", required_argument, NULL, O_SPEC },
        { "insecure-listen", no_argument, NULL, O_INSECURE },
        { "insecure-control", no_argument, NULL, O_INSECURE_CTL },
        { "comm-net-devices", required_argument, NULL, O_NET_DEVS },
        { "threads", required_argument, NULL, O_THREADS },
        { "exact", no_argument, NULL, O_EXACT },
        { "mock", no_argument, NULL, O_MOCK },
        { "max-seqs", required_argument, NULL, O_MAX_SEQS },
        { "max-num-seqs", required_argument, NULL, O_MAX_SEQS },
        { "max-batched-tokens", required_argument, NULL, O_MAX_BT },
        { "max-model-len", required_argument, NULL, O_MAX_LEN },
        { "kv-blocks", required_argument, NULL, O_KV },
        { "kv-cache-memory", required_argument, NULL, O_KV_MEM },
        { "gpu-memory-utilization", required_argument, NULL, O_GPU_UTIL },
        { "kv-cache-dtype", required_argument, NULL, O_KV_DTYPE },
        { "enable-prefix-caching", no_argument, NULL, O_PREFIX_ON },
        { "no-enable-prefix-caching", no_argument, NULL, O_PREFIX_OFF },
        { "prefix-cache-salt", required_argument, NULL, O_PREFIX_SALT },
        { "block-size", required_argument, NULL, O_BS },
        { "rendezvous-timeout", required_argument, NULL, O_RDV_TO },
        { "collective-timeout", required_argument, NULL, O_COLL_TO },
        { "generate", required_argument, NULL, O_GEN },
        { "max-tokens", required_argument, NULL, O_MAX_TOK },
        { "output", required_argument, NULL, O_OUT },
        { "dump-logits", required_argument, NULL, O_LOGITS },
        { "prompt-ids", required_argument, NULL, O_PROMPT },
        { "step-delay", required_argument, NULL, O_DELAY },
        { "report", required_argument, NULL, O_REPORT },
        { "engine-listen", required_argument, NULL, O_ENGINE },
        { "control-key-file", required_argument, NULL, O_CKEY },
        { "load-timeout", required_argument, NULL, O_LOAD_TO },
        { "health-listen", required_argument, NULL, O_HEALTH },
        { "control-tls-ca", required_argument, NULL, O_TLS_CA },
        { "control-tls-cert", required_argument, NULL, O_TLS_CERT },
        { "control-tls-key", required_argument, NULL, O_TLS_KEY },
        { "max-waiting", required_argument, NULL, O_MAX_WAIT },
        { "logprobs-mode", required_argument, NULL, O_LP_MODE },
        { "help", no_argument, NULL, O_HELP },
        { "version", no_argument, NULL, O_VERSION },
        { "check-device", required_argument, NULL, O_CHECK_DEV },
        { "allow-long-max-model-len", no_argument, NULL, O_ALLOW_LONG },
        { 0 },
    };
    struct worker_opts o;
    const char *ckey_file = NULL, *net_devs = NULL;
    char tag[96], key[512];
    int c, r = 0;

    worker_opts_init(&o);
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_COORD: o.coordinator = optarg; break;
        case O_RDV: o.rendezvous_dir = optarg; break;
        case O_GROUP: o.group = optarg; break;
        case O_RANK: r = parse_int(optarg, "--rank", 0, 255, &o.rank); break;
        case O_WORLD: r = parse_int(optarg, "--world-size", 1, 8, &o.world_size); break;
        case O_DEVICE: o.device = optarg; break;
        case O_MODEL: o.model_dir = optarg; break;
        case O_MTP_MODEL: o.mtp_dir = optarg; break;
        case O_MTP: r = parse_mtp(optarg, &o.spec); break;
        case O_SPEC: r = parse_spec(optarg, &o.spec); break;
        case O_INSECURE: o.insecure_listen = true; break;
        case O_INSECURE_CTL: o.insecure_control = true; break;
        case O_NET_DEVS: net_devs = optarg; break;
        case O_THREADS: r = parse_int(optarg, "--threads", 0, 1024, &o.threads); break;
        case O_EXACT: o.exact = true; break;
        case O_MOCK: o.mock = true; break;
        case O_MAX_SEQS: r = parse_int(optarg, "--max-seqs", 1, 4096, &o.max_seqs); break;
        case O_MAX_BT: r = parse_int(optarg, "--max-batched-tokens", 4, 1 << 20, &o.max_batched_tokens); break;
        case O_MAX_LEN: r = parse_int(optarg, "--max-model-len", 2, 1 << 22, &o.max_model_len); break;
        case O_KV: r = parse_int(optarg, "--kv-blocks", 0, 1 << 24, &o.kv_blocks); break;
        case O_KV_MEM: r = parse_bytes(optarg, "--kv-cache-memory", &o.kv_cache_memory); break;
        case O_GPU_UTIL: r = parse_fraction(optarg, "--gpu-memory-utilization",
                                            &o.gpu_memory_utilization); break;
        case O_KV_DTYPE: r = parse_kv_dtype(optarg, &o.kv_f32); break;
        case O_PREFIX_ON: o.no_prefix_cache = false; break;
        case O_PREFIX_OFF: o.no_prefix_cache = true; break;
        case O_PREFIX_SALT: o.prefix_cache_salt = optarg; break;
        case O_BS: r = parse_int(optarg, "--block-size", 1, 4096, &o.block_size); break;
        case O_RDV_TO: r = parse_int(optarg, "--rendezvous-timeout", 1, INT_MAX, &o.rendezvous_timeout_msec); break;
        case O_COLL_TO: r = parse_int(optarg, "--collective-timeout", 1, INT_MAX, &o.collective_timeout_msec); break;
        case O_GEN: o.generate_file = optarg; break;
        case O_MAX_TOK: r = parse_int(optarg, "--max-tokens", 1, 1 << 20, &o.max_tokens); break;
        case O_OUT: o.output_file = optarg; break;
        case O_LOGITS: o.logits_file = optarg; break;
        case O_PROMPT: o.prompt_ids = optarg; break;
        case O_DELAY: r = parse_int(optarg, "--step-delay", 0, 60000, &o.step_delay_msec); break;
        case O_REPORT: o.report_file = optarg; break;
        case O_ENGINE: o.engine_listen = optarg; break;
        case O_CKEY: ckey_file = optarg; break;
        case O_HEALTH: o.health_listen = optarg; break;
        case O_LOAD_TO: r = parse_int(optarg, "--load-timeout", 1, INT_MAX, &o.load_timeout_msec); break;
        case O_TLS_CA: o.control_tls.root_file = optarg; break;
        case O_TLS_CERT: o.control_tls.cert_file = optarg; break;
        case O_TLS_KEY: o.control_tls.key_file = optarg; break;
        case O_MAX_WAIT: r = parse_int(optarg, "--max-waiting", 1, 1 << 20, &o.max_waiting); break;
        case O_LP_MODE:
            if (strcmp(optarg, "raw_logprobs") == 0) {
                o.logprobs_processed = false;
            } else if (strcmp(optarg, "processed_logprobs") == 0) {
                o.logprobs_processed = true;
            } else {
                fprintf(stderr, "stepd-worker: --logprobs-mode '%s': expected raw_logprobs or "
                        "processed_logprobs\n", optarg);
                r = -EINVAL;
            }
            break;
        case O_HELP: usage(stdout); return 0;
        case O_VERSION: printf("stepd-worker %s\n", STEPD_VERSION); return 0;
        case O_CHECK_DEV: return check_device(optarg);
        case O_ALLOW_LONG: o.allow_long_max_model_len = true; break;
        default: usage(stderr); return WORKER_EXIT_USAGE;
        }
        if (r < 0)
            return WORKER_EXIT_USAGE;
    }
    if (o.spec.model[0] && !o.mtp_dir)
        o.mtp_dir = o.spec.model;           /* --speculative-config's "model" */
    if (optind < argc) {
        fprintf(stderr, "stepd-worker: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return WORKER_EXIT_USAGE;
    }
    if (o.device && strcmp(o.device, "cpu") != 0 && strncmp(o.device, "cuda:", 5) != 0) {
        fprintf(stderr, "stepd-worker: --device '%s': expected cpu or cuda:N\n", o.device);
        return WORKER_EXIT_USAGE;
    }
    if (!o.control_tls.cert_file != !o.control_tls.key_file || (o.control_tls.cert_file && !o.control_tls.root_file)) {
        fprintf(stderr, "stepd-worker: --control-tls-cert and --control-tls-key go together, with "
                "--control-tls-ca\n");
        return WORKER_EXIT_USAGE;
    }
    o.control_key = getenv("STEPD_CONTROL_KEY");
    if (ckey_file) {
        char *k;
        int kr = file_read_secret(ckey_file, &k);

        if (kr < 0) {
            fprintf(stderr, "stepd-worker: --control-key-file %s: %s\n", ckey_file,
                    kr == -ENODATA ? "file is empty" : strerror(-kr));
            return WORKER_EXIT_USAGE;
        }
        snprintf(key, sizeof(key), "%s", k);
        free(k);
        o.control_key = key;
    }
    if (net_devs) {
        if (!net_devs[0]) {
            fprintf(stderr, "stepd-worker: --comm-net-devices: empty (give a device, e.g. lo or eth0)\n");
            return WORKER_EXIT_USAGE;
        }
        /* UCX reads its configuration from the environment when the comm is made */
        setenv("UCX_NET_DEVICES", net_devs, 1);
    }
    snprintf(tag, sizeof(tag), "%.64s/r%d", o.group, o.rank);
    log_init("stepd-worker", tag);
    signal(SIGPIPE, SIG_IGN);
    if (supervised_by_parent() < 0)
        return WORKER_EXIT_FAILURE;
    return worker_run(&o);
}
