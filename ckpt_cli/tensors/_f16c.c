/* FP32 -> FP16 with the x86 F16C instruction (vcvtps2ph), bit for bit numpy's cast.
 *
 * numpy casts FP32 to FP16 one element at a time (issue 28753); this converts a vector of 8
 * per instruction, 32 per loop iteration, rounding to nearest even like numpy. The
 * instruction quiets a signalling NaN (sets the top payload bit) where numpy keeps the
 * payload's top 10 bits as they are (an all-zero payload becomes 1): a group of vectors
 * holding a NaN is redone lane by lane with numpy's rule, so every output bit is numpy's.
 * Chosen at run time: `available` is false where the CPU lacks F16C/AVX, or the compiler is
 * not GCC/Clang on x86-64, and ckpt_cli.tensors.cast then uses its numpy kernel. The GIL is
 * released while converting, so blocks convert on all cores.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define CKPT_F16C 1
#include <immintrin.h>
#else
#define CKPT_F16C 0
#endif

/* numpy's bits for an FP32 NaN: sign, all-ones exponent, top 10 payload bits (0 -> 1). */
static uint16_t nan_bits(uint32_t f) {
    uint16_t payload = (uint16_t)((f >> 13) & 0x3FFu);
    if (payload == 0) {
        payload = 1;
    }
    return (uint16_t)(((f >> 16) & 0x8000u) | 0x7C00u | payload);
}

#if CKPT_F16C
/* Lanes of src[0..count) that hold a NaN get numpy's bits in dst. */
static void fix_nans(const float *src, uint16_t *dst, int count) {
    for (int j = 0; j < count; j++) {
        uint32_t f;
        memcpy(&f, src + j, sizeof f);
        if ((f & 0x7FFFFFFFu) > 0x7F800000u) {
            dst[j] = nan_bits(f);
        }
    }
}

#define CKPT_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define CKPT_NAN(v) _mm256_cmp_ps((v), (v), _CMP_UNORD_Q)

__attribute__((target("avx,f16c")))
static void convert(const float *src, uint16_t *dst, Py_ssize_t n) {
    Py_ssize_t i = 0;
    /* 32 at a time, one NaN test for the four vectors: the loop keeps pace with torch's
     * (a test and branch per vector of 8 cost ~30% in cache). */
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_loadu_ps(src + i), b = _mm256_loadu_ps(src + i + 8);
        __m256 c = _mm256_loadu_ps(src + i + 16), d = _mm256_loadu_ps(src + i + 24);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(a, CKPT_RN));
        _mm_storeu_si128((__m128i *)(dst + i + 8), _mm256_cvtps_ph(b, CKPT_RN));
        _mm_storeu_si128((__m128i *)(dst + i + 16), _mm256_cvtps_ph(c, CKPT_RN));
        _mm_storeu_si128((__m128i *)(dst + i + 24), _mm256_cvtps_ph(d, CKPT_RN));
        __m256 nan = _mm256_or_ps(_mm256_or_ps(CKPT_NAN(a), CKPT_NAN(b)),
                                  _mm256_or_ps(CKPT_NAN(c), CKPT_NAN(d)));
        if (_mm256_movemask_ps(nan)) {
            fix_nans(src + i, dst + i, 32);
        }
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(src + i);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(v, CKPT_RN));
        if (_mm256_movemask_ps(CKPT_NAN(v))) {
            fix_nans(src + i, dst + i, 8);
        }
    }
    if (i < n) {
        /* The tail through the same instruction, on a zero-padded vector. */
        float buf[8] = {0};
        uint16_t out[8];
        memcpy(buf, src + i, (size_t)(n - i) * sizeof(float));
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(buf), CKPT_RN);
        _mm_storeu_si128((__m128i *)out, h);
        for (Py_ssize_t j = 0; i + j < n; j++) {
            uint32_t f;
            memcpy(&f, buf + j, sizeof f);
            dst[i + j] = (f & 0x7FFFFFFFu) > 0x7F800000u ? nan_bits(f) : out[j];
        }
    }
}

static int cpu_has_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
#endif

/* Whether this CPU runs `convert`: asked once, when the module loads. */
static int have_f16c = 0;

static PyObject *f32_to_f16(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_obj, *dst_obj;
    if (!PyArg_ParseTuple(args, "OO", &src_obj, &dst_obj)) {
        return NULL;
    }
#if CKPT_F16C
    if (!have_f16c) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no F16C instructions");
        return NULL;
    }
    Py_buffer src, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (src.len % 4 != 0 || dst.len % 2 != 0 || src.len / 4 != dst.len / 2) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError,
                        "src must hold 4-byte floats and dst as many 2-byte halves");
        return NULL;
    }
    Py_ssize_t n = src.len / 4;
    Py_BEGIN_ALLOW_THREADS
    convert((const float *)src.buf, (uint16_t *)dst.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
#else
    (void)src_obj;
    (void)dst_obj;
    PyErr_SetString(PyExc_RuntimeError, "built without F16C support");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"f32_to_f16", f32_to_f16, METH_VARARGS,
     "f32_to_f16(src, dst): FP32 values of the contiguous buffer src into dst as FP16 bits, "
     "rounded to nearest even, NaN bits as numpy gives them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_f16c", "FP32 -> FP16 with the F16C instruction.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__f16c(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
#if CKPT_F16C
    have_f16c = cpu_has_f16c();
#endif
    if (PyModule_AddObject(m, "available", PyBool_FromLong(have_f16c)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
