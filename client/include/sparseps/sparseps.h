/* sparseps client library, C interface: the C++ Worker of sparseps/client.h behind an opaque
 * handle, pointers and sizes, so that any language binds it without being built for it (Python
 * through ctypes: python/sparseps/capi.py, which loads in any CPython 3 and any PyTorch).
 *
 * Every call that can fail returns a SPARSEPS_* code and, when err is not NULL, writes the cause
 * in words into err (at most err_len bytes, NUL-terminated); SPARSEPS_OK is 0. Sizes are in
 * elements (float32); memory is the caller's (host memory) and is only read or written during the
 * call. Thread-safety: a worker handle belongs to one thread at a time; different handles are
 * independent. The calls block while they wait for the job (as the C++ Worker's do).
 */
#ifndef SPARSEPS_SPARSEPS_H_
#define SPARSEPS_SPARSEPS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  SPARSEPS_OK = 0,
  SPARSEPS_INVALID_ARGUMENT = 1, /* bad input or config (the cause names the key, file or size) */
  SPARSEPS_DEADLINE_EXCEEDED =
      2,                    /* a wait ran past its deadline (the cause names who is missing) */
  SPARSEPS_FAILED = 3,      /* anything else: the job ended, a peer failed, I/O */
  SPARSEPS_INTERRUPTED = 4, /* SIGINT ended a wait (sparseps_worker_set_interruptible) */
  SPARSEPS_ROLLED_BACK =
      5, /* a server was replaced: back at the checkpoint (sparseps_worker_step) */
  /* This worker is out of the job (cut off from the scheduler, or removed by it after it was
     silent for cluster.heartbeat_timeout_s); the job may go on without it: exit with code 3, as
     the daemons do. */
  SPARSEPS_LOST = 6,
  /* A replacement (node.rejoin) came as or after the job ended (sparseps_worker_init): nothing to
     join, nothing failed: exit with code 0, as the daemons do. */
  SPARSEPS_JOB_ENDED = 7
};

/* sparseps_buffer.device of host memory; a CUDA device's ordinal otherwise. */
#define SPARSEPS_HOST (-1)

/* float32 elements lent for the length of one call: host memory, or (device >= 0, a library
 * built with CUDA: sparseps_cuda_build) that CUDA device's memory. */
typedef struct sparseps_buffer {
  float* data;
  size_t size; /* elements */
  int device;
} sparseps_buffer;

/* What the last push-pull did (see sparseps::client::StepCounters). */
typedef struct sparseps_step_counters {
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t selected; /* entries this worker's compression selected */
  int64_t applied;   /* allreduce: entries the update changed; -1: not counted (PS) */
  double encode_ms;
  double comm_ms;
} sparseps_step_counters;

typedef struct sparseps_worker sparseps_worker;

/* The library's version ("0.1.0"), static storage. */
const char* sparseps_version(void);
/* 1 when the library was built with CUDA (buffers may be in device memory), else 0. */
int sparseps_cuda_build(void);
/* The CUDA device ordinal of a pointer, or SPARSEPS_HOST. */
int sparseps_device_of(const void* pointer);

/* Loads the job's config (config_path; NULL or "" for the defaults) with the overrides
 * ("key=value", num_overrides of them; NULL when none) and the rank (>= 0, else node.rank, else
 * SPARSEPS_RANK or RANK, else the scheduler's choice); *out is the new handle (NULL on error). */
int sparseps_worker_new(const char* config_path, const char* const* overrides, size_t num_overrides,
                        int rank, sparseps_worker** out, char* err, size_t err_len);
/* Frees a handle (NULL: nothing). A worker that did not finish leaves the job. */
void sparseps_worker_free(sparseps_worker* worker);

/* Joins the job with n parameters; on return params holds the job's starting ones. */
int sparseps_worker_init(sparseps_worker* worker, float* params, size_t n, char* err,
                         size_t err_len);
/* One step: aggregates grad (n elements; changed in place) and writes the job's new parameters
 * into params (n elements; with SBC's local steps, the local copy the next gradient is computed
 * at). NaN or Inf in grad: SPARSEPS_INVALID_ARGUMENT, nothing sent. */
int sparseps_worker_push_pull(sparseps_worker* worker, float* grad, float* params, size_t n,
                              char* err, size_t err_len);
/* Joins with a model of `count` buffers (all on one device) and writes the job's starting
 * parameters into them; names (count of them, or NULL) name the model file's tensors. */
int sparseps_worker_init_buffers(sparseps_worker* worker, const sparseps_buffer* params,
                                 size_t count, const char* const* names, char* err, size_t err_len);
/* As sparseps_worker_init_buffers, with each tensor's shape: tensor i has ndims[i] dimensions,
 * the next ndims[i] entries of dims (all the shapes one after the other; their product is the
 * buffer's size, or SPARSEPS_INVALID_ARGUMENT). A method that works layer by layer
 * (collective.algorithm: powersgd) compresses each tensor as the matrix of its first dimension
 * by the rest; with init_buffers every tensor is a vector, which it sums densely. names: count
 * of them, or NULL ("param<i>"; "params" for one tensor). */
int sparseps_worker_init_tensors(sparseps_worker* worker, const sparseps_buffer* params,
                                 size_t count, const char* const* names, const size_t* ndims,
                                 const uint64_t* dims, char* err, size_t err_len);
/* One step returning the update: grads laid out as init's buffers (or one of all the elements),
 * on init's device; update (host, num_params elements, zero on entry) gets old minus new
 * parameters where they changed. loss: the step's training loss for the live metrics (NaN:
 * none). */
int sparseps_worker_push_pull_update(sparseps_worker* worker, const sparseps_buffer* grads,
                                     size_t count, float* update, double loss, char* err,
                                     size_t err_len);
/* The same step with a sparse result: *num_changed is the number of keys that changed; read
 * them with sparseps_worker_sparse_result before the next step. */
int sparseps_worker_push_pull_sparse(sparseps_worker* worker, const sparseps_buffer* grads,
                                     size_t count, double loss, size_t* num_changed, char* err,
                                     size_t err_len);
/* train.overlap: backward (ps mode; host memory, or a CUDA device where the encoding has a device
 * compressor): starts this step's aggregation on grad, the one flat buffer of all num_params
 * elements on init's device that the backward pass is writing and that the step's
 * push_pull_sparse gets; each server key range is pushed once gradient_ready has reported it.
 * *begun: 1, or 0 (nothing started) where the job does not overlap. */
int sparseps_worker_begin_step(sparseps_worker* worker, const sparseps_buffer* grad, int* begun,
                               char* err, size_t err_len);
/* After begin_step: grad[key_begin, num_params) is final for this step (on a device: the kernels
 * that wrote it completed). Thread-safe. */
int sparseps_worker_gradient_ready(sparseps_worker* worker, size_t key_begin, char* err,
                                   size_t err_len);
/* The last sparse step's keys (increasing), update (old minus new) and new parameters there,
 * num_changed of each (any may be NULL: not wanted). */
int sparseps_worker_sparse_result(const sparseps_worker* worker, int64_t* keys, float* update,
                                  float* params, size_t num_changed, char* err, size_t err_len);
/* Copies the job's parameters as this worker holds them, or its residual, into out (n:
 * num_params). */
int sparseps_worker_params(const sparseps_worker* worker, float* out, size_t n, char* err,
                           size_t err_len);
int sparseps_worker_residual(const sparseps_worker* worker, float* out, size_t n, char* err,
                             size_t err_len);
/* Nonzero: SIGINT during a call's wait ends it at once with SPARSEPS_INTERRUPTED (the program's
 * own handler is back after each call). */
void sparseps_worker_set_interruptible(sparseps_worker* worker, int interruptible);
/* ssp / async: waits for every worker's pushes of as many steps and writes the parameters. */
int sparseps_worker_synchronize(sparseps_worker* worker, float* params, size_t n, char* err,
                                size_t err_len);
/* The parameters worker 0 saves as the trained model at finish instead of the job's (n =
 * num_params; see sparseps::client::Worker::SetTrainedModel). */
int sparseps_worker_set_trained_model(sparseps_worker* worker, const float* params, size_t n,
                                      char* err, size_t err_len);
/* The model's buffers (BatchNorm's running statistics) that worker 0 writes beside the
 * parameters into the trained model file at finish and into a checkpoint's model file at
 * set_checkpoint_state, replacing earlier ones (count 0: none):
 * buffer i is names[i], of ndims[i] dimensions shapes[i][0..ndims[i]) (elements; 0 dimensions: a
 * scalar), with values[i] (their product of floats, copied). See
 * sparseps::client::Worker::SetModelBuffers. */
int sparseps_worker_set_model_buffers(sparseps_worker* worker, size_t count,
                                      const char* const* names, const uint64_t* const* shapes,
                                      const size_t* ndims, const float* const* values, char* err,
                                      size_t err_len);
/* Right after the push-pull that took a checkpoint (checkpoint_due): the loop's own state
 * (state_n bytes; may be 0) for this worker's checkpoint file and, on worker 0, the model for the
 * checkpoint's model file (model_n = num_params, or 0: the job's parameters), with the buffers
 * set last by set_model_buffers; see
 * sparseps::client::Worker::SetCheckpointState. */
int sparseps_worker_set_checkpoint_state(sparseps_worker* worker, const uint8_t* state,
                                         size_t state_n, const float* model, size_t model_n,
                                         char* err, size_t err_len);
/* The loop's own state in the checkpoint resumed from or rolled back to: writes at most capacity
 * bytes into out (may be NULL) and returns how many there are (0: none). */
size_t sparseps_worker_checkpoint_state(const sparseps_worker* worker, uint8_t* out,
                                        size_t capacity);
/* A replacement's hand-over (see sparseps::client::Worker::Handoff). On the donor, after the
 * push-pull of the iteration a replacement joined at (sparseps_worker_handoff_due): the loop's
 * state (state_n bytes; may be 0) and model (model_n = num_params, or 0: none) go to it. */
int sparseps_worker_send_handoff(sparseps_worker* worker, const uint8_t* state, size_t state_n,
                                 const float* model, size_t model_n, char* err, size_t err_len);
/* On a replacement after its first push-pull (sparseps_worker_handoff_expected): waits for the
 * donor's hand-over and keeps it in the handle; *from is the donor's rank, *state_n and *model_n
 * its sizes (bytes, elements; any pointer may be NULL), read with sparseps_worker_handoff_state
 * and sparseps_worker_handoff_model. When nothing came both are 0 and
 * sparseps_worker_handoff_missing says why (empty: the donor's loop handed nothing over). */
int sparseps_worker_receive_handoff(sparseps_worker* worker, int* from, size_t* state_n,
                                    size_t* model_n, char* err, size_t err_len);
/* The last hand-over received: writes at most capacity bytes (elements) into out (may be NULL)
 * and returns how many there are. */
size_t sparseps_worker_handoff_state(const sparseps_worker* worker, uint8_t* out, size_t capacity);
size_t sparseps_worker_handoff_model(const sparseps_worker* worker, float* out, size_t capacity);
/* Why the last hand-over holds nothing, NUL-terminated into out (at most out_len bytes; empty:
 * nothing missing); returns the bytes the whole text needs, NUL included. */
size_t sparseps_worker_handoff_missing(const sparseps_worker* worker, char* out, size_t out_len);
/* The test accuracy (a fraction) of the loop's evaluation: the live metrics' gauge and finish's
 * default (see sparseps::client::Worker::ReportEvaluation). */
int sparseps_worker_report_evaluation(sparseps_worker* worker, double test_accuracy, char* err,
                                      size_t err_len);
/* Sums values[0, n) over the live workers into sums[0, n) (see
 * sparseps::client::Worker::AllreduceValues); *contributors (may be NULL): how many workers. */
int sparseps_worker_allreduce_values(sparseps_worker* worker, const double* values, size_t n,
                                     double* sums, uint32_t* contributors, char* err,
                                     size_t err_len);
/* Scales the top-k k from the next push (see sparseps::client::Worker::SetDensityScale). */
int sparseps_worker_set_density_scale(sparseps_worker* worker, double scale, char* err,
                                      size_t err_len);
/* The epoch the loop is in (0-based). */
int sparseps_worker_set_epoch(sparseps_worker* worker, uint32_t epoch, char* err, size_t err_len);
/* Ends this worker's part (see sparseps::client::Worker::Finish); test_accuracy -1: not
 * evaluated here. */
int sparseps_worker_finish(sparseps_worker* worker, double test_accuracy, double train_loss,
                           double samples_per_s, double train_s, char* err, size_t err_len);

/* Facts of a handle (never fail). */
int sparseps_worker_rank(const sparseps_worker* worker);
int sparseps_worker_num_workers(const sparseps_worker* worker);
int sparseps_worker_is_leader(const sparseps_worker* worker);
size_t sparseps_worker_num_params(const sparseps_worker* worker);
uint64_t sparseps_worker_step(const sparseps_worker* worker);
double sparseps_worker_lr(const sparseps_worker* worker);
uint64_t sparseps_worker_bytes_sent(const sparseps_worker* worker);
uint64_t sparseps_worker_bytes_received(const sparseps_worker* worker);
int sparseps_worker_resumed(const sparseps_worker* worker);        /* resumed from a checkpoint */
int sparseps_worker_rejoined(const sparseps_worker* worker);       /* a replacement (node.rejoin) */
int sparseps_worker_checkpoint_due(const sparseps_worker* worker); /* the last step checkpoints */
int sparseps_worker_handoff_due(const sparseps_worker* worker);    /* a replacement waits for us */
int sparseps_worker_handoff_expected(const sparseps_worker* worker); /* our donor's is coming */
int sparseps_worker_allreduce(const sparseps_worker* worker);        /* else a parameter server */
/* What the last push-pull did (zeros for a NULL handle). */
void sparseps_worker_last_step(const sparseps_worker* worker, sparseps_step_counters* out);
/* The ranks of the live workers, increasing: writes at most capacity into ranks and returns how
 * many there are. */
size_t sparseps_worker_live_workers(const sparseps_worker* worker, int* ranks, size_t capacity);
/* The share of the training data of the epoch that begins after `step` steps: shard *index of
 * *count (sparseps::client::Worker::data_split: the live workers' after a membership change, so
 * that every worker re-splits at the same epoch). Fails before init. */
int sparseps_worker_data_split(const sparseps_worker* worker, uint64_t step, int* index, int* count,
                               char* err, size_t err_len);
/* Every key of the resolved config as "key = value" lines (as --get prints them), NUL-terminated
 * into out (at most out_len bytes); returns the bytes the whole text needs, NUL included. */
size_t sparseps_worker_config(const sparseps_worker* worker, char* out, size_t out_len);

#ifdef __cplusplus
}
#endif

#endif /* SPARSEPS_SPARSEPS_H_ */
