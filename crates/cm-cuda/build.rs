//! Compiles every kernel variant of `cm-kernels` to an sm_90a CUBIN with NVRTC and embeds them.
//!
//! NVRTC is found through `CM_NVRTC_DIR`, the `nvidia/cu13/lib` directory of the
//! `nvidia-cuda-nvrtc==13.0.88` wheel (`scripts/install-nvrtc.sh` installs it and prints the
//! path). Without it the crate still builds, embeds no CUBIN, warns, and the runtime answers
//! every launch with an error saying how to rebuild. With it, a compile error or a register
//! spill in a forward kernel fails the build. CUBINs are cached under `CM_KERNEL_CACHE_DIR`
//! (default `<target dir>/cm-kernels-cache`) by the SHA-256 of sources, options and compiler,
//! so a rebuild with unchanged kernels compiles nothing.

use cm_kernels::{PtxasReport, Variant, VARIANTS};
use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const NVRTC_LIB: &str = "libnvrtc.so.13";
// libnvrtc opens this by name at compile time; loading it first by absolute path means no
// LD_LIBRARY_PATH is needed.
const NVRTC_BUILTINS_LIB: &str = "libnvrtc-builtins.so.13.0";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CM_NVRTC_DIR");
    println!("cargo:rerun-if-env-changed=CM_KERNEL_CACHE_DIR");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let generated = match std::env::var_os("CM_NVRTC_DIR").filter(|d| !d.is_empty()) {
        None => {
            println!(
                "cargo:warning=cm-cuda: CM_NVRTC_DIR is not set, so no CUDA kernels are embedded; \
                 CPU commands (check, plan, intervals, show, export, list, demo) are unaffected. \
                 Only GPU kernel launches (bench, compilemask.attention) need them: run \
                 scripts/install-nvrtc.sh and rebuild with CM_NVRTC_DIR=<the directory it prints>"
            );
            unavailable(
                "cm-cuda was built without CUBINs (CM_NVRTC_DIR was not set at build time); run \
                 scripts/install-nvrtc.sh and rebuild with CM_NVRTC_DIR=<the directory it prints>",
            )
        }
        Some(dir) => match build_all(Path::new(&dir), &out_dir) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("error: cm-cuda kernel build failed: {e}");
                std::process::exit(1);
            }
        },
    };
    std::fs::write(out_dir.join("kernels.rs"), generated).expect("OUT_DIR is writable");
}

fn unavailable(reason: &str) -> String {
    format!("pub(crate) static EMBEDDED: Result<[EmbeddedKernel; VARIANT_COUNT], &str> = Err({reason:?});\n")
}

/// Compiles (or takes from the cache) every variant and returns the generated Rust table.
fn build_all(nvrtc_dir: &Path, out_dir: &Path) -> Result<String, String> {
    let lib_path = nvrtc_dir.join(NVRTC_LIB);
    println!("cargo:rerun-if-changed={}", lib_path.display());
    let nvrtc = Nvrtc::load(nvrtc_dir)?;
    let lib_len = std::fs::metadata(&lib_path)
        .map_err(|e| format!("{}: {e}", lib_path.display()))?
        .len();
    let (major, minor) = nvrtc.version()?;
    if (major, minor) != (13, 0) {
        return Err(format!(
            "{} is NVRTC {major}.{minor}; the GPU machine's driver needs CUBINs from NVRTC 13.0 \
             (install nvidia-cuda-nvrtc==13.0.88 with scripts/install-nvrtc.sh)",
            lib_path.display()
        ));
    }
    let compiler_id = format!("nvrtc {major}.{minor} {NVRTC_LIB} {lib_len} bytes");
    let cache_dir = cache_dir(out_dir);
    std::fs::create_dir_all(&cache_dir)
        .map_err(|e| format!("cannot create {}: {e}", cache_dir.display()))?;

    let results: Vec<Result<(PathBuf, PtxasReport), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = VARIANTS
            .iter()
            .map(|v| {
                let (nvrtc, cache_dir, compiler_id) = (&nvrtc, &cache_dir, &compiler_id);
                s.spawn(move || build_variant(nvrtc, v, cache_dir, compiler_id))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("compile thread panicked".into()))
            })
            .collect()
    });

    let mut code = String::from(
        "pub(crate) static EMBEDDED: Result<[EmbeddedKernel; VARIANT_COUNT], &str> = Ok([\n",
    );
    let mut summary = String::new();
    for (v, r) in VARIANTS.iter().zip(results) {
        let (cubin, rep) = r?;
        let embedded = out_dir.join(format!("{}.cubin", v.name()));
        std::fs::copy(&cubin, &embedded)
            .map_err(|e| format!("copy to {}: {e}", embedded.display()))?;
        writeln!(
            code,
            "    EmbeddedKernel {{ bytes: include_bytes!({:?}), registers: {}, spill_bytes: {}, shared_bytes: {} }},",
            embedded.display().to_string(),
            rep.registers,
            rep.spill_store_bytes + rep.spill_load_bytes,
            rep.shared_bytes
        )
        .expect("write to String");
        writeln!(
            summary,
            "{}: {} registers, {} bytes spill stores, {} bytes spill loads, {} bytes smem",
            v.name(),
            rep.registers,
            rep.spill_store_bytes,
            rep.spill_load_bytes,
            rep.shared_bytes
        )
        .expect("write to String");
    }
    code.push_str("]);\n");
    std::fs::write(out_dir.join("ptxas-report.txt"), summary)
        .map_err(|e| format!("write report: {e}"))?;
    Ok(code)
}

/// `CM_KERNEL_CACHE_DIR`, else `<target dir>/cm-kernels-cache`, shared by every profile.
fn cache_dir(out_dir: &Path) -> PathBuf {
    if let Some(dir) = std::env::var_os("CM_KERNEL_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out.
    out_dir
        .ancestors()
        .nth(4)
        .unwrap_or(out_dir)
        .join("cm-kernels-cache")
}

fn build_variant(
    nvrtc: &Nvrtc,
    v: &Variant,
    cache_dir: &Path,
    compiler_id: &str,
) -> Result<(PathBuf, PtxasReport), String> {
    let key = cm_kernels::cache_key(v, compiler_id);
    let cubin_path = cache_dir.join(format!("{}-{key}.cubin", v.name()));
    let log_path = cache_dir.join(format!("{}-{key}.log", v.name()));
    let log = match (
        std::fs::metadata(&cubin_path),
        std::fs::read_to_string(&log_path),
    ) {
        (Ok(_), Ok(log)) => log,
        _ => {
            let (cubin, log) = nvrtc.compile(v)?;
            // Write to temporary names first so an interrupted build never leaves a
            // half-written entry under the final key.
            let tmp_cubin = cubin_path.with_extension(format!("cubin.tmp{}", std::process::id()));
            let tmp_log = log_path.with_extension(format!("log.tmp{}", std::process::id()));
            std::fs::write(&tmp_cubin, cubin)
                .map_err(|e| format!("{}: {e}", tmp_cubin.display()))?;
            std::fs::write(&tmp_log, &log).map_err(|e| format!("{}: {e}", tmp_log.display()))?;
            std::fs::rename(&tmp_cubin, &cubin_path)
                .map_err(|e| format!("{}: {e}", cubin_path.display()))?;
            std::fs::rename(&tmp_log, &log_path)
                .map_err(|e| format!("{}: {e}", log_path.display()))?;
            log
        }
    };
    let report = cm_kernels::parse_ptxas_log(&log, v.kernel.entry_point())
        .map_err(|e| format!("{}: {e}", v.name()))?;
    cm_kernels::check_report(v, &report)?;
    let spills = report.spill_store_bytes + report.spill_load_bytes;
    if spills > 0 {
        // Allowed outside forward kernels, but each needs a measured reason in BENCHMARKS.md.
        println!(
            "cargo:warning=cm-cuda: {} spills registers ({} bytes stores, {} bytes loads at {} registers)",
            v.name(),
            report.spill_store_bytes,
            report.spill_load_bytes,
            report.registers
        );
    }
    Ok((cubin_path, report))
}

type NvrtcProgram = *mut std::ffi::c_void;
type NvrtcResult = c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
type CreateFn = unsafe extern "C" fn(
    *mut NvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type CompileFn = unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult;
type SizeFn = unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult;
type GetFn = unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult;
type DestroyFn = unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult;
type ErrorStringFn = unsafe extern "C" fn(NvrtcResult) -> *const c_char;

/// The NVRTC entry points, resolved from the wheel's library by absolute path so that no other
/// libnvrtc on the system can be picked up by accident.
struct Nvrtc {
    version: VersionFn,
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    cubin_size: SizeFn,
    cubin: GetFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
    // The function pointers above point into these; they must outlive every call.
    _libs: [libloading::Library; 2],
}

impl Nvrtc {
    #[allow(unsafe_code)]
    fn load(dir: &Path) -> Result<Nvrtc, String> {
        let open = |name: &str| {
            let path = dir.join(name);
            // SAFETY: loading runs the library's initialisers; these are NVIDIA's NVRTC
            // libraries from the pinned wheel, whose initialisers have no preconditions.
            unsafe { libloading::Library::new(&path) }.map_err(|e| {
                format!(
                    "cannot load {} ({e}); is CM_NVRTC_DIR the wheel's nvidia/cu13/lib?",
                    path.display()
                )
            })
        };
        let builtins = open(NVRTC_BUILTINS_LIB)?;
        let lib = open(NVRTC_LIB)?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the type matches the NVRTC 13 C declaration of this function
                // (nvrtc.h); the pointer is only used while `lib` is alive (kept in `_libs`).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{NVRTC_LIB} has no {}: {e}", $name))?
            };
        }
        Ok(Nvrtc {
            version: sym!("nvrtcVersion"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            destroy: sym!("nvrtcDestroyProgram"),
            error_string: sym!("nvrtcGetErrorString"),
            _libs: [builtins, lib],
        })
    }

    #[allow(unsafe_code)]
    fn check(&self, what: &str, r: NvrtcResult) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code.
        let msg = unsafe { CStr::from_ptr((self.error_string)(r)) }.to_string_lossy();
        Err(format!("{what} failed: {msg} ({r})"))
    }

    #[allow(unsafe_code)]
    fn version(&self) -> Result<(i32, i32), String> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: both pointers are valid for writes of one c_int.
        self.check("nvrtcVersion", unsafe {
            (self.version)(&mut major, &mut minor)
        })?;
        Ok((major, minor))
    }

    /// Compiles one variant; returns the CUBIN and the compile log (ptxas `-v` report).
    #[allow(unsafe_code)]
    fn compile(&self, v: &Variant) -> Result<(Vec<u8>, String), String> {
        let file = v.source_file();
        let cstr = |s: &str| CString::new(s).map_err(|_| format!("NUL byte in {s:?}"));
        let src =
            cstr(cm_kernels::source(file).ok_or_else(|| format!("no kernel source {file}"))?)?;
        let name = cstr(file)?;
        let (header_names, header_texts): (Vec<CString>, Vec<CString>) = cm_kernels::headers()
            .map(|(n, t)| Ok((cstr(n)?, cstr(t)?)))
            .collect::<Result<Vec<_>, String>>()?
            .into_iter()
            .unzip();
        let header_name_ptrs: Vec<*const c_char> =
            header_names.iter().map(|s| s.as_ptr()).collect();
        let header_text_ptrs: Vec<*const c_char> =
            header_texts.iter().map(|s| s.as_ptr()).collect();
        let options: Vec<CString> = cm_kernels::nvrtc_options(v)
            .iter()
            .map(|o| cstr(o))
            .collect::<Result<_, _>>()?;
        let option_ptrs: Vec<*const c_char> = options.iter().map(|s| s.as_ptr()).collect();

        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer refers to a NUL-terminated string owned by a local that outlives
        // the program; the header arrays have `header_names.len()` entries each.
        self.check("nvrtcCreateProgram", unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                header_names.len() as c_int,
                header_text_ptrs.as_ptr(),
                header_name_ptrs.as_ptr(),
            )
        })?;
        // SAFETY: `prog` was created above and is destroyed exactly once, after its last use,
        // below; the option array has `option_ptrs.len()` valid C strings.
        let compiled =
            unsafe { (self.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
        let result = self.log_of(prog).and_then(|log| {
            self.check("nvrtcCompileProgram", compiled)
                .map_err(|e| format!("{}: {e}\n{log}", v.name()))?;
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; `size` is valid for one write.
            self.check("nvrtcGetCUBINSize", unsafe {
                (self.cubin_size)(prog, &mut size)
            })?;
            if size == 0 {
                return Err(format!(
                    "{}: NVRTC produced no CUBIN (is the target a real sm_ arch?)",
                    v.name()
                ));
            }
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` has exactly the size NVRTC reported for this program.
            self.check("nvrtcGetCUBIN", unsafe {
                (self.cubin)(prog, cubin.as_mut_ptr().cast())
            })?;
            Ok((cubin, log))
        });
        // SAFETY: `prog` is a live program and is not used after this call.
        self.check("nvrtcDestroyProgram", unsafe { (self.destroy)(&mut prog) })?;
        result
    }

    #[allow(unsafe_code)]
    fn log_of(&self, prog: NvrtcProgram) -> Result<String, String> {
        let mut size = 0usize;
        // SAFETY: `prog` is a live program; `size` is valid for one write.
        self.check("nvrtcGetProgramLogSize", unsafe {
            (self.log_size)(prog, &mut size)
        })?;
        let mut log = vec![0u8; size.max(1)];
        // SAFETY: `log` holds the reported size, NUL terminator included.
        self.check("nvrtcGetProgramLog", unsafe {
            (self.log)(prog, log.as_mut_ptr().cast())
        })?;
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        Ok(String::from_utf8_lossy(&log[..end]).into_owned())
    }
}
