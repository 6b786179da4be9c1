// data.cu -- building a training batch from a dataset kept on the device.
//
// images (n_images, h, w) uint8 and labels (n_images) int32 live on the
// device; indices (batch) int32 picks the images of this batch.  Output:
//   out_images (batch, 1, h + 2 pad, w + 2 pad) float32 and
//   out_labels (batch) int32 = labels[indices].
//
// For each batch row b, the image is scaled to [0, 1] (pixel / 255), shifted
// by (sy, sx) inside its h x w frame (what moves out is lost, what moves in
// is zero), surrounded by `pad` zero pixels, then normalised (v - mean) / std.
// The shift of row b is a pure function of (seed, b):
//   r  = splitmix64(seed ^ splitmix64(b))
//   sx = (r & 0xffffffff) % (2 max_shift + 1) - max_shift     (64-bit unsigned %)
//   sy = (r >> 32)        % (2 max_shift + 1) - max_shift
// A source pixel at (i, j) lands at (i + sy, j + sx).
//
// Float expressions, chosen so the numpy twin (images / 255 in float32, then
// (v - mean) / std in float32) matches bit for bit:
//   v   = (float)pixel / 255.0f        (0.0f for a shifted-in or padded pixel)
//   out = (v - mean) / std
// Both are single IEEE-rounded float32 operations (nvcc's default -prec-div=true;
// building with --use_fast_math would break the bit-for-bit match).
#include <climits>

#include "common.cuh"

namespace {

// ------------------------------------------------------------ the kernel
// One thread per output pixel (b, c, oy, ox) of out_images, grid-stride; the first `batch` threads
// (same grid-stride) also copy the labels.  An index outside [0, n_images) (the caller should have
// checked) reads nothing: its pixels become NaN and its label -1, which the loss kernel reports as a
// bad label.  gather_batch (one channel, no flip) runs the same kernel with channels = 1.
// gather_batch_chw: as gather_batch for images of `channels` planes, with a per-channel mean
// and std and an optional horizontal flip.  Row b's randomness, a pure function of (seed, b):
//   r    = splitmix64(seed ^ splitmix64(b))
//   sx   = (r & 0xffffffff) % (2 max_shift + 1) - max_shift      (as gather_batch)
//   sy   = (r >> 32)        % (2 max_shift + 1) - max_shift
//   flip = flip_enabled && (splitmix64(r) >> 63)                  (one bit of a second hash)
// Output pixel (b, c, oy, ox): (iy, ix) = (oy - pad, ox - pad) in the h x w frame reads
// source column src_x = ix - sx, mirrored to w - 1 - src_x when flipped, and row iy - sy:
// the image is flipped first, then shifted (zero fill), so shift + pad together are a random
// crop of the zero-padded image.  v = (float)pixel / 255.0f (0.0f where nothing is read),
// out = (v - mean[c]) / std[c]: the numpy twin's float32 operations, bit for bit.
struct ChannelStats {
    float mean[CYDNN_GATHER_MAX_CHANNELS];
    float std[CYDNN_GATHER_MAX_CHANNELS];
};

__global__ void gather_batch_chw_kernel(const uint8_t *images, const int32_t *labels, int n_images,
                                        int channels, int h, int w, const int32_t *indices, int batch,
                                        ChannelStats stats, int pad, int max_shift, int flip_enabled,
                                        uint64_t seed, float *out_images, int32_t *out_labels) {
    const int out_h = h + 2 * pad;
    const int out_w = w + 2 * pad;
    const size_t out_plane = (size_t)out_h * out_w;
    const size_t out_image = out_plane * channels;
    const size_t total = (size_t)batch * out_image;
    const uint64_t span = 2 * (uint64_t)max_shift + 1;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;

    for (size_t idx = tid; idx < total; idx += stride) {
        const int ox = (int)(idx % out_w);
        const int oy = (int)((idx / out_w) % out_h);
        const int c = (int)((idx / out_plane) % channels);
        const size_t b = idx / out_image;
        const int32_t index = indices[b];
        if (index < 0 || index >= n_images) {
            out_images[idx] = __int_as_float(0x7fc00000);  // NaN
            continue;
        }

        float v = 0.0f;
        const int iy = oy - pad, ix = ox - pad;
        if (iy >= 0 && iy < h && ix >= 0 && ix < w) {
            const uint64_t r = cydnn::splitmix64(seed ^ cydnn::splitmix64((uint64_t)b));
            const int sx = (int)((r & 0xffffffffull) % span) - max_shift;
            const int sy = (int)((r >> 32) % span) - max_shift;
            const bool flip = flip_enabled && (cydnn::splitmix64(r) >> 63);
            const int src_y = iy - sy;
            int src_x = ix - sx;
            if (src_y >= 0 && src_y < h && src_x >= 0 && src_x < w) {
                if (flip) src_x = w - 1 - src_x;
                const uint8_t *plane = images + ((size_t)index * channels + c) * h * w;
                v = (float)plane[(size_t)src_y * w + src_x] / 255.0f;
            }
        }
        out_images[idx] = (v - stats.mean[c]) / stats.std[c];
    }

    if (labels != nullptr && out_labels != nullptr)
        for (size_t b = tid; b < (size_t)batch; b += stride) {
            const int32_t index = indices[b];
            out_labels[b] = (index >= 0 && index < n_images) ? labels[index] : -1;
        }
}

}  // namespace

cydnnStatus_t cydnn_gather_batch(cydnnContext *ctx, const uint8_t *images, const int32_t *labels,
                                 int n_images, int h, int w, const int32_t *indices, int batch,
                                 float mean, float std, int pad, int max_shift, uint64_t seed,
                                 float *out_images, int32_t *out_labels) {
    CYDNN_REQUIRE_CTX("gather_batch", ctx);
    CYDNN_REQUIRE("gather_batch", images != nullptr, "images is NULL");
    CYDNN_REQUIRE("gather_batch", indices != nullptr, "indices is NULL");
    CYDNN_REQUIRE("gather_batch", out_images != nullptr, "out_images is NULL");
    CYDNN_REQUIRE("gather_batch", out_labels == nullptr || labels != nullptr,
                  "out_labels is given but labels is NULL");
    CYDNN_REQUIRE("gather_batch", n_images >= 1 && h >= 1 && w >= 1 && batch >= 1,
                  "sizes must be >= 1 (n_images=%d, h=%d, w=%d, batch=%d)", n_images, h, w,
                  batch);
    CYDNN_REQUIRE("gather_batch", pad >= 0 && max_shift >= 0,
                  "pad and max_shift must be >= 0 (pad=%d, max_shift=%d)", pad, max_shift);
    CYDNN_REQUIRE("gather_batch",
                  (long long)h + 2LL * pad <= INT_MAX && (long long)w + 2LL * pad <= INT_MAX,
                  "padded size overflows int (h=%d, w=%d, pad=%d)", h, w, pad);

    // (n, h, w) images are (n, 1, h, w) ones without a flip: the same kernel, the same bits.
    ChannelStats stats{};
    stats.mean[0] = mean;
    stats.std[0] = std;
    const size_t total = (size_t)batch * (size_t)(h + 2 * pad) * (size_t)(w + 2 * pad);
    gather_batch_chw_kernel<<<cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream>>>(
        images, labels, n_images, 1, h, w, indices, batch, stats, pad, max_shift, 0, seed, out_images,
        out_labels);
    CYDNN_LAUNCH_CHECK("gather_batch", "gather_batch_chw_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_gather_batch_chw(cydnnContext *ctx, const uint8_t *images, const int32_t *labels,
                                     int n_images, int channels, int h, int w, const int32_t *indices,
                                     int batch, const float *mean, const float *std, int pad,
                                     int max_shift, int flip, uint64_t seed, float *out_images,
                                     int32_t *out_labels) {
    CYDNN_REQUIRE_CTX("gather_batch_chw", ctx);
    CYDNN_REQUIRE("gather_batch_chw", images != nullptr, "images is NULL");
    CYDNN_REQUIRE("gather_batch_chw", indices != nullptr, "indices is NULL");
    CYDNN_REQUIRE("gather_batch_chw", out_images != nullptr, "out_images is NULL");
    CYDNN_REQUIRE("gather_batch_chw", mean != nullptr && std != nullptr, "mean or std is NULL");
    CYDNN_REQUIRE("gather_batch_chw", out_labels == nullptr || labels != nullptr,
                  "out_labels is given but labels is NULL");
    CYDNN_REQUIRE("gather_batch_chw", n_images >= 1 && h >= 1 && w >= 1 && batch >= 1,
                  "sizes must be >= 1 (n_images=%d, h=%d, w=%d, batch=%d)", n_images, h, w, batch);
    CYDNN_REQUIRE("gather_batch_chw", channels >= 1 && channels <= CYDNN_GATHER_MAX_CHANNELS,
                  "channels must lie in [1, %d], got %d", CYDNN_GATHER_MAX_CHANNELS, channels);
    CYDNN_REQUIRE("gather_batch_chw", pad >= 0 && max_shift >= 0,
                  "pad and max_shift must be >= 0 (pad=%d, max_shift=%d)", pad, max_shift);
    CYDNN_REQUIRE("gather_batch_chw",
                  (long long)h + 2LL * pad <= INT_MAX && (long long)w + 2LL * pad <= INT_MAX,
                  "padded size overflows int (h=%d, w=%d, pad=%d)", h, w, pad);

    ChannelStats stats;
    for (int c = 0; c < channels; ++c) {
        CYDNN_REQUIRE("gather_batch_chw", std[c] > 0.0f, "std[%d] must be > 0, got %g", c, (double)std[c]);
        stats.mean[c] = mean[c];
        stats.std[c] = std[c];
    }
    for (int c = channels; c < CYDNN_GATHER_MAX_CHANNELS; ++c) {
        stats.mean[c] = 0.0f;
        stats.std[c] = 1.0f;
    }

    const size_t total = (size_t)batch * channels * (size_t)(h + 2 * pad) * (size_t)(w + 2 * pad);
    gather_batch_chw_kernel<<<cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream>>>(
        images, labels, n_images, channels, h, w, indices, batch, stats, pad, max_shift, flip != 0, seed,
        out_images, out_labels);
    CYDNN_LAUNCH_CHECK("gather_batch_chw", "gather_batch_chw_kernel");
    return CYDNN_STATUS_SUCCESS;
}
