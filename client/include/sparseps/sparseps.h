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
      2,              /* a wait ran past its deadline (the cause names who is missing) */
  SPARSEPS_FAILED = 3 /* anything else: the job ended, a peer failed, I/O */
};

typedef struct sparseps_worker sparseps_worker;

/* The library's version ("0.1.0"), static storage. */
const char* sparseps_version(void);

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
/* ssp / async: waits for every worker's pushes of as many steps and writes the parameters. */
int sparseps_worker_synchronize(sparseps_worker* worker, float* params, size_t n, char* err,
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

#ifdef __cplusplus
}
#endif

#endif /* SPARSEPS_SPARSEPS_H_ */
