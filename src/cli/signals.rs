//! SIGINT and SIGTERM while an output is being written: the partial file beside its target
//! (`.NAME.shardc-PID.tmp`) is removed and that is said. Either way the process then ends as
//! the signal ends it.

use std::ffi::CString;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The temporary file being written, if any (a `CString` leaked while it is set).
static WRITING: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());

extern "C" fn on_signal(sig: libc::c_int) {
    // Only what is async-signal-safe: unlink, write, signal, raise.
    let p = WRITING.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if !p.is_null() {
        let msg: &[u8] = b"\nshardc: interrupted while writing an output; the partial file was removed\n";
        // SAFETY: `p` came from `CString::into_raw` and is no longer reachable elsewhere;
        // writing a static buffer to stderr.
        unsafe {
            libc::unlink(p);
            libc::write(2, msg.as_ptr().cast(), msg.len());
        }
    }
    // SAFETY: ending as the signal would have.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs the handlers (once, at start).
pub fn install() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler does only async-signal-safe work.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Marks `path` as the temporary file being written until the guard is dropped (after the
/// rename, or its removal on error).
pub fn writing(path: &std::path::Path) -> Writing {
    use std::os::unix::ffi::OsStrExt;
    if let Ok(c) = CString::new(path.as_os_str().as_bytes()) {
        let old = WRITING.swap(c.into_raw(), Ordering::SeqCst);
        free(old);
    }
    Writing
}

/// See [`writing`].
pub struct Writing;

impl Drop for Writing {
    fn drop(&mut self) {
        free(WRITING.swap(std::ptr::null_mut(), Ordering::SeqCst));
    }
}

fn free(p: *mut libc::c_char) {
    if !p.is_null() {
        // SAFETY: `p` came from `CString::into_raw` and was taken out of `WRITING`.
        drop(unsafe { CString::from_raw(p) });
    }
}
