/*
 * ciera.h: the C ABI of libciera.so, a lossless, cross-iteration compressed Allgather.
 *
 * Hand-kept beside src/capi.rs; tests/capi_c.rs compiles a program against this header and
 * checks every enum value, struct size and field offset against the Rust side.
 *
 * Modelled on nccl.h: cieraResult_t numbers are ncclResult_t's (0..7), cieraDataType_t numbers
 * are ncclDataType_t's, communicators are opaque handles, configs and statistics are versioned
 * structs (size, magic, version first; new fields only ever appended).
 *
 * Memory and streams: every buffer is HOST memory, and a collective has completed when it
 * returns. The stream argument keeps NCCL's signatures and is ignored. Pointers the CUDA driver
 * reports as device or managed memory (checked only when the process has loaded libcuda) are
 * refused with cieraInvalidArgument.
 *
 * Errors: every call checks its pointers and ranges; cieraGetLastError() then names the
 * argument and the values. A destroyed, aborted or made-up communicator handle gives
 * cieraInvalidUsage (handles are never reused). No call crashes on bad arguments it can see;
 * buffers that are too short for their counts cannot be seen and remain the caller's duty.
 *
 * Link: cc app.c -I include -L target/release -lciera -Wl,-rpath,$PWD/target/release
 */
#ifndef CIERA_H_
#define CIERA_H_

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CIERA_MAJOR 0
#define CIERA_MINOR 1
#define CIERA_PATCH 0
#define CIERA_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))
#define CIERA_VERSION_CODE CIERA_VERSION(CIERA_MAJOR, CIERA_MINOR, CIERA_PATCH)

/* Opaque communicator handle. Never dereference it. */
typedef struct cieraComm* cieraComm_t;
#define CIERA_COMM_NULL NULL

#define CIERA_UNIQUE_ID_BYTES 128
/* Made by cieraGetUniqueId on one rank, handed to every rank (it is a credential: whoever
 * holds it can join the job). */
typedef struct { char internal[CIERA_UNIQUE_ID_BYTES]; } cieraUniqueId;

/* Result codes, numbered as ncclResult_t. */
typedef enum {
  cieraSuccess            = 0,
  cieraUnhandledCudaError = 1,
  cieraSystemError        = 2, /* network, file, timeout */
  cieraInternalError      = 3, /* a bug in CIERA */
  cieraInvalidArgument    = 4,
  cieraInvalidUsage       = 5, /* destroyed handle, ranks disagreeing, unsupported */
  cieraRemoteError        = 6, /* a peer failed, died, aborted or sent corrupt data */
  cieraInProgress         = 7,
  cieraNumResults         = 8
} cieraResult_t;

/* Element types, numbered as ncclDataType_t. */
typedef enum {
  cieraInt8       = 0, cieraChar   = 0,
  cieraUint8      = 1,
  cieraInt32      = 2, cieraInt    = 2,
  cieraUint32     = 3,
  cieraInt64      = 4,
  cieraUint64     = 5,
  cieraFloat16    = 6, cieraHalf   = 6,
  cieraFloat32    = 7, cieraFloat  = 7,
  cieraFloat64    = 8, cieraDouble = 8,
  cieraBfloat16   = 9,
  cieraFloat8e4m3 = 10,
  cieraFloat8e5m2 = 11,
  cieraNumTypes   = 12
} cieraDataType_t;

/* A config field left at this value takes its value from the environment (CIERA_TIMEOUT,
 * CIERA_COMPRESS, CIERA_CACHE_MB, CIERA_TRANSPORT, CIERA_VERIFY) or the default. */
#define CIERA_CONFIG_UNDEF_INT INT_MIN
#define CIERA_API_MAGIC 0x43494552u /* "CIER" */

typedef enum {
  cieraCompressionAuto  = 0, /* compress bf16/fp16/fp32 where it measurably pays */
  cieraCompressionOn    = 1,
  cieraCompressionOff   = 2,
  cieraCompressionUnset = CIERA_CONFIG_UNDEF_INT
} cieraCompression_t;

typedef enum {
  cieraTransportAuto  = 0, /* shared memory on one host, TCP across hosts */
  cieraTransportShm   = 1,
  cieraTransportTcp   = 2,
  cieraTransportUnset = CIERA_CONFIG_UNDEF_INT
} cieraTransport_t;

/* Communicator configuration (version 1). Initialize with CIERA_CONFIG_INITIALIZER, then set
 * the fields you want; the rest keep CIERA_CONFIG_UNDEF_INT. */
typedef struct cieraConfig_v1 {
  size_t size;           /* set by the initializer; do not touch */
  unsigned int magic;    /* set by the initializer; do not touch */
  unsigned int version;  /* set by the initializer; do not touch */
  int timeoutMs;         /* > 0: how long any wait may make no progress before it fails */
  int compression;       /* cieraCompression_t */
  int cacheBudgetMB;     /* >= 0: memory all cache slots of the communicator may use (MiB) */
  int transport;         /* cieraTransport_t */
  int verify;            /* 1: compare a hash of every decoded shard with the sender's; 0: don't */
} cieraConfig_t;

#define CIERA_CONFIG_INITIALIZER {                  \
  sizeof(cieraConfig_t),    /* size */              \
  CIERA_API_MAGIC,          /* magic */             \
  1,                        /* version */           \
  CIERA_CONFIG_UNDEF_INT,   /* timeoutMs */         \
  CIERA_CONFIG_UNDEF_INT,   /* compression */       \
  CIERA_CONFIG_UNDEF_INT,   /* cacheBudgetMB */     \
  CIERA_CONFIG_UNDEF_INT,   /* transport */         \
  CIERA_CONFIG_UNDEF_INT    /* verify */            \
}

/* Per-communicator statistics (version 1), filled by cieraCommGetStats up to `size`. */
typedef struct cieraStats_v1 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  uint64_t calls;        /* AllGather calls completed successfully */
  uint64_t inPlaceCalls; /* of which in place */
  uint64_t failedCalls;  /* calls that failed after their arguments were accepted */
  uint64_t rawCalls;     /* calls that travelled uncompressed (type, size, budget, back-off) */
  uint64_t fillCalls;    /* compressed-path calls that filled the caches */
  uint64_t deltaCalls;   /* calls sent as deltas against last iteration's caches */
  uint64_t repairs;      /* frames that failed to decode or verify and were redone raw */
  uint64_t rawBytes;     /* bytes of the gathered tensors (nranks*sendcount*size per call) */
  uint64_t wireBytes;    /* bytes that stood for them on the wire; rawBytes/wireBytes = ratio */
  uint64_t cacheBytes;   /* memory the caches hold now */
  uint64_t encodeNs;     /* time this rank spent encoding */
  uint64_t decodeNs;     /* time this rank spent decoding */
  uint64_t misses;       /* sources with no cache of their shard (moved buffer, evicted or reset
                            cache) that sent it as FILL frames in a compressed call; not repairs */
} cieraStats_t;

#define CIERA_STATS_INITIALIZER { sizeof(cieraStats_t), CIERA_API_MAGIC, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* CIERA_VERSION_CODE of the library. */
cieraResult_t cieraGetVersion(int* version);

/* A new job id; starts the job's rendezvous root as a thread of this process, which serves one
 * job and waits at most CIERA_TIMEOUT (default 300 s) for the last rank to join. */
cieraResult_t cieraGetUniqueId(cieraUniqueId* uniqueId);

/* Join job `commId` as `rank` of `nranks` (blocks until every rank has joined). On failure
 * *comm is set to NULL. */
cieraResult_t cieraCommInitRank(cieraComm_t* comm, int nranks, cieraUniqueId commId, int rank);
/* As cieraCommInitRank; config may be NULL. */
cieraResult_t cieraCommInitRankConfig(cieraComm_t* comm, int nranks, cieraUniqueId commId, int rank,
                                      cieraConfig_t* config);
/* Extension: join the job a launcher describes in the environment (ciera launch, mpirun, srun,
 * torchrun: rank, size and rendezvous from CIERA_RANK/OMPI_COMM_WORLD_RANK/SLURM_PROCID/RANK
 * etc.). config may be NULL. */
cieraResult_t cieraCommInitFromEnv(cieraComm_t* comm, cieraConfig_t* config);

/* Every rank contributes sendcount elements; rank r's land at recvbuff + r*sendcount*size.
 * In place when sendbuff == recvbuff + rank*sendcount*size; any other overlap is
 * cieraInvalidArgument. NULL buffers are allowed only with sendcount == 0.
 * Host memory: the call returns when the gather is complete; stream is ignored.
 * CUDA device memory (both buffers; the process has loaded the driver and a context is
 * current): as ncclAllGather, the gather is queued on stream (a CUstream / cudaStream_t, NULL
 * the default stream) and the call returns; work queued on stream afterwards sees the result.
 * A failure of the exchange itself (a peer died, a timeout) is reported by
 * cieraCommGetAsyncError, and every later call returns it. */
cieraResult_t cieraAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                             cieraDataType_t datatype, cieraComm_t comm, void* stream);
/* As cieraAllGather; `key` names the tensor (the same key for the same tensor every iteration)
 * so the cache it is compressed against is chosen by name rather than by call order. Results
 * never depend on the key. */
cieraResult_t cieraAllGatherKeyed(const void* sendbuff, void* recvbuff, size_t sendcount,
                                  cieraDataType_t datatype, uint64_t key, cieraComm_t comm,
                                  void* stream);

/* Abort a collective in flight on comm (from any thread; it returns cieraRemoteError and the
 * peers are told) and free the handle. NULL: no-op. */
cieraResult_t cieraCommAbort(cieraComm_t comm);
/* Free the handle; the communicator goes when a call still running on it returns (device-memory
 * calls queued on streams run first; every rank must destroy, as with NCCL). NULL: no-op.
 * A handle destroyed twice: cieraInvalidUsage. */
cieraResult_t cieraCommDestroy(cieraComm_t comm);
/* cieraSuccess while comm is usable; otherwise the code of the failure that broke it, whose
 * message cieraGetLastError then returns (on this thread). */
cieraResult_t cieraCommGetAsyncError(cieraComm_t comm, cieraResult_t* asyncError);
cieraResult_t cieraCommCount(const cieraComm_t comm, int* count);
cieraResult_t cieraCommUserRank(const cieraComm_t comm, int* rank);
/* Fill *stats, initialized with CIERA_STATS_INITIALIZER. */
cieraResult_t cieraCommGetStats(cieraComm_t comm, cieraStats_t* stats);

/* Host memory that ranks on this host read straight out of each other (no kernel copy):
 * allocate collective buffers with it for the fastest shared-memory path; any other host
 * memory works too. Zeroed; size 0 gives a unique pointer to no bytes. Free with cieraMemFree
 * (NULL: no-op; a pointer not from cieraMemAlloc: cieraInvalidArgument). */
cieraResult_t cieraMemAlloc(void** ptr, size_t size);
cieraResult_t cieraMemFree(void* ptr);

/* A static string for a result code. */
const char* cieraGetErrorString(cieraResult_t result);
/* The message of the last call on this thread that failed ("" if none), naming the call, the
 * argument and the values. Valid until the next failing call on this thread; comm may be NULL. */
const char* cieraGetLastError(cieraComm_t comm);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CIERA_H_ */
