/* Prints every constant, enum value, struct size and field offset of include/ciera.h as
 * "name value" lines; tests/capi_c.rs compares them with src/capi.rs. */
#include <ciera.h>
#include <stddef.h>
#include <stdio.h>

#define V(x) printf("%s %lld\n", #x, (long long)(x))
#define SZ(t) printf("sizeof(%s) %zu\n", #t, sizeof(t))
#define OFF(t, f) printf("offsetof(%s,%s) %zu\n", #t, #f, offsetof(t, f))

int main(void) {
    V(CIERA_VERSION_CODE); V(CIERA_API_MAGIC); V(CIERA_CONFIG_UNDEF_INT); V(CIERA_UNIQUE_ID_BYTES);
    V(cieraSuccess); V(cieraUnhandledCudaError); V(cieraSystemError); V(cieraInternalError);
    V(cieraInvalidArgument); V(cieraInvalidUsage); V(cieraRemoteError); V(cieraInProgress); V(cieraNumResults);
    V(cieraInt8); V(cieraChar); V(cieraUint8); V(cieraInt32); V(cieraInt); V(cieraUint32); V(cieraInt64);
    V(cieraUint64); V(cieraFloat16); V(cieraHalf); V(cieraFloat32); V(cieraFloat); V(cieraFloat64);
    V(cieraDouble); V(cieraBfloat16); V(cieraFloat8e4m3); V(cieraFloat8e5m2); V(cieraNumTypes);
    V(cieraCompressionAuto); V(cieraCompressionOn); V(cieraCompressionOff); V(cieraCompressionUnset);
    V(cieraTransportAuto); V(cieraTransportShm); V(cieraTransportTcp); V(cieraTransportUnset);
    SZ(cieraUniqueId); SZ(cieraComm_t); SZ(cieraResult_t); SZ(cieraDataType_t);
    SZ(cieraConfig_t);
    OFF(cieraConfig_t, size); OFF(cieraConfig_t, magic); OFF(cieraConfig_t, version);
    OFF(cieraConfig_t, timeoutMs); OFF(cieraConfig_t, compression); OFF(cieraConfig_t, cacheBudgetMB);
    OFF(cieraConfig_t, transport); OFF(cieraConfig_t, verify);
    SZ(cieraStats_t);
    OFF(cieraStats_t, size); OFF(cieraStats_t, magic); OFF(cieraStats_t, version); OFF(cieraStats_t, calls);
    OFF(cieraStats_t, inPlaceCalls); OFF(cieraStats_t, failedCalls); OFF(cieraStats_t, rawCalls);
    OFF(cieraStats_t, fillCalls); OFF(cieraStats_t, deltaCalls); OFF(cieraStats_t, repairs);
    OFF(cieraStats_t, rawBytes); OFF(cieraStats_t, wireBytes); OFF(cieraStats_t, cacheBytes);
    OFF(cieraStats_t, encodeNs); OFF(cieraStats_t, decodeNs); OFF(cieraStats_t, misses);
    cieraConfig_t c = CIERA_CONFIG_INITIALIZER;
    printf("initializer.version %u\n", c.version);
    printf("initializer.size %zu\n", c.size);
    printf("initializer.timeoutMs %d\n", c.timeoutMs);
    printf("initializer.verify %d\n", c.verify);
    cieraStats_t s = CIERA_STATS_INITIALIZER;
    printf("stats_initializer.version %u\n", s.version);
    return 0;
}
