// XLA FFI handler `pk_uninitialized`: a result buffer whose contents are left as they are (no kernel, no memset).
// Its one operand is never read: it carries the result's sharding axes in JAX (pk_jax/context/window_exchange.py).
// Ulysses' pipeline (pk_jax/context/ulysses.py) places each own block into such a buffer early and lets the
// windowed exchange fill the rest; a zero fill would cost a pass over the buffer on XLA's stream, which is what
// placing early saves. No per-call host state: command-buffer safe.
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error leave_uninitialized(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkUninitialized, leave_uninitialized,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
