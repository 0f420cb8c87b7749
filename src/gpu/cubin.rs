//! What a compiled kernel file holds, read without a GPU: the entry points of a cubin (its ELF
//! symbol table and the register counts in its `.nv.info` section) and the per-kernel resource
//! report ptxas writes into NVRTC's program log under `-Xptxas -v`. Both readers are plain
//! parsers of bytes and text; [`super::nvrtc`] calls them, and the compile test checks one
//! against the other.
#![forbid(unsafe_code)]

/// The resources one `__global__` function uses, as ptxas reported them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The symbol name (unmangled for `extern "C"` kernels).
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Named barriers the kernel uses (`__syncthreads` is barrier 0).
    pub barriers: u32,
    /// Bytes stored to local memory because registers ran out (0 for a kernel that fits).
    pub spill_stores: u32,
    /// Bytes loaded back from those spills.
    pub spill_loads: u32,
    /// Static shared memory per block (`__shared__` arrays; dynamic shared memory is not
    /// counted).
    pub shared_bytes: u32,
    /// Local memory per thread: the stack frame (local arrays indexed at run time, spills).
    pub local_bytes: u32,
}

impl KernelResources {
    /// Whether ptxas had to spill registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// Reads ptxas's verbose report (NVRTC's program log under `-Xptxas -v`) into one entry per
/// kernel, in the order ptxas compiled them. Non-entry (`__noinline__ __device__`) functions
/// have a "Function properties" line of their own and are not listed. Lines this reader does
/// not know are skipped, so a log without the report gives an empty list.
///
/// ```text
/// ptxas info    : Compiling entry function 'add' for 'sm_90'
/// ptxas info    : Function properties for add
/// ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem
/// ```
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    // The entry being reported on, and the function the last "properties" line named.
    let mut entry: Option<KernelResources> = None;
    let mut properties_of: Option<String> = None;
    for line in log.lines() {
        let Some(rest) = line.strip_prefix("ptxas") else {
            continue;
        };
        // "info    : ...", "        .     ...": drop the tag and the separator.
        let body = rest
            .trim_start()
            .trim_start_matches("info")
            .trim_start()
            .trim_start_matches([':', '.'])
            .trim();
        if let Some(r) = body.strip_prefix("Compiling entry function '") {
            out.extend(entry.take());
            let name = r.split('\'').next().unwrap_or("");
            entry = Some(KernelResources {
                name: name.to_string(),
                ..KernelResources::default()
            });
            properties_of = None;
        } else if let Some(r) = body.strip_prefix("Function properties for ") {
            properties_of = Some(r.trim().to_string());
        } else if let Some(e) = entry.as_mut() {
            let own_properties = properties_of.as_deref() == Some(e.name.as_str());
            if body.contains("stack frame") && own_properties {
                for (n, what) in quantities(body) {
                    match what {
                        "bytes stack frame" => e.local_bytes = n,
                        "bytes spill stores" => e.spill_stores = n,
                        "bytes spill loads" => e.spill_loads = n,
                        _ => {}
                    }
                }
            } else if body.starts_with("Used ") {
                for (n, what) in quantities(body) {
                    match what {
                        "registers" => e.registers = n,
                        "barriers" => e.barriers = n,
                        "bytes smem" => e.shared_bytes = n,
                        _ => {}
                    }
                }
            }
        }
    }
    out.extend(entry);
    out
}

/// "Used 10 registers, used 1 barriers, 1024 bytes smem" -> (10, "registers"), (1,
/// "barriers"), (1024, "bytes smem").
fn quantities(body: &str) -> impl Iterator<Item = (u32, &str)> {
    body.split(',').filter_map(|part| {
        let part = part.trim();
        let part = part
            .strip_prefix("Used ")
            .or_else(|| part.strip_prefix("used "))
            .unwrap_or(part);
        let (n, what) = part.split_once(' ')?;
        Some((n.parse().ok()?, what.trim()))
    })
}

/// One kernel entry point of a cubin, as its ELF file says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CubinEntry {
    pub name: String,
    /// Registers per thread (`EIATTR_REGCOUNT` in `.nv.info`), None if the file does not say.
    pub registers: Option<u32>,
}

/// Why a cubin could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CubinError(pub String);

impl std::fmt::Display for CubinError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed cubin: {}", self.0)
    }
}

impl std::error::Error for CubinError {}

const SHT_SYMTAB: u32 = 2;
const STT_FUNC: u8 = 2;
/// `st_other` bit that marks a kernel entry point (CUDA's STO_CUDA_ENTRY).
const STO_CUDA_ENTRY: u8 = 0x10;
/// `.nv.info` attribute formats (the first byte of every record) and the one attribute read.
const EIFMT_NVAL: u8 = 1;
const EIFMT_BVAL: u8 = 2;
const EIFMT_HVAL: u8 = 3;
const EIFMT_SVAL: u8 = 4;
const EIATTR_REGCOUNT: u8 = 0x2f;

/// The kernel entry points of a cubin (a 64-bit little-endian ELF file from ptxas or NVRTC):
/// every `FUNC` symbol marked as an entry, with its register count from the file-wide
/// `.nv.info` section, in symbol-table order.
pub fn cubin_entries(cubin: &[u8]) -> Result<Vec<CubinEntry>, CubinError> {
    let elf = Elf::new(cubin)?;
    let (symtab, strtab) = elf.symbol_table()?;
    let mut entries = Vec::new();
    let mut by_symbol = Vec::new();
    for (index, sym) in symtab.chunks_exact(24).enumerate() {
        let (name, info, other) = (u32_at(sym, 0)?, sym[4], sym[5]);
        if info & 0xf == STT_FUNC && other & STO_CUDA_ENTRY != 0 {
            by_symbol.push((index as u32, entries.len()));
            entries.push(CubinEntry {
                name: c_str(strtab, name as usize)?.to_string(),
                registers: None,
            });
        }
    }
    if let Some(info) = elf.section_named(".nv.info")? {
        for (attr, value) in nv_info_records(info)? {
            if attr == EIATTR_REGCOUNT && value.len() == 8 {
                let (sym, regs) = (u32_at(value, 0)?, u32_at(value, 4)?);
                if let Some(&(_, i)) = by_symbol.iter().find(|(s, _)| *s == sym) {
                    entries[i].registers = Some(regs);
                }
            }
        }
    }
    Ok(entries)
}

/// The (attribute, value) records of an `.nv.info` section; only SVAL records carry a value.
fn nv_info_records(mut b: &[u8]) -> Result<Vec<(u8, &[u8])>, CubinError> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let (format, attr) = (b[0], b[1]);
        match format {
            EIFMT_SVAL => {
                let len = u16::from_le_bytes([b[2], b[3]]) as usize;
                let value = b
                    .get(4..4 + len)
                    .ok_or_else(|| CubinError(format!(".nv.info record of {len} bytes cut off")))?;
                out.push((attr, value));
                b = &b[4 + len..];
            }
            EIFMT_NVAL | EIFMT_BVAL | EIFMT_HVAL => b = &b[4..],
            _ => return Err(CubinError(format!(".nv.info record format {format}"))),
        }
    }
    Ok(out)
}

struct Elf<'a> {
    bytes: &'a [u8],
    /// (name offset, type, offset, size, link) of every section.
    sections: Vec<(u32, u32, usize, usize, u32)>,
    names: &'a [u8],
}

impl<'a> Elf<'a> {
    fn new(bytes: &'a [u8]) -> Result<Elf<'a>, CubinError> {
        if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
            return Err(CubinError("no ELF header".into()));
        }
        if bytes[4] != 2 || bytes[5] != 1 {
            return Err(CubinError("not a 64-bit little-endian ELF file".into()));
        }
        let shoff = u64_at(bytes, 0x28)? as usize;
        let shentsize = u16_at(bytes, 0x3a)? as usize;
        let shnum = u16_at(bytes, 0x3c)? as usize;
        let shstrndx = u16_at(bytes, 0x3e)? as usize;
        if shentsize < 64 {
            return Err(CubinError(format!("section headers of {shentsize} bytes")));
        }
        let mut sections = Vec::with_capacity(shnum);
        for i in 0..shnum {
            let at = shoff
                .checked_add(i * shentsize)
                .ok_or_else(|| CubinError("section header offset overflows".into()))?;
            let h = bytes
                .get(at..at + 64)
                .ok_or_else(|| CubinError(format!("section header {i} past the end")))?;
            sections.push((
                u32_at(h, 0)?,
                u32_at(h, 4)?,
                u64_at(h, 0x18)? as usize,
                u64_at(h, 0x20)? as usize,
                u32_at(h, 0x28)?,
            ));
        }
        let mut elf = Elf {
            bytes,
            sections,
            names: &[],
        };
        elf.names = elf.section_bytes(shstrndx)?;
        Ok(elf)
    }

    fn section_bytes(&self, i: usize) -> Result<&'a [u8], CubinError> {
        let &(_, _, off, size, _) = self
            .sections
            .get(i)
            .ok_or_else(|| CubinError(format!("no section {i}")))?;
        off.checked_add(size)
            .and_then(|end| self.bytes.get(off..end))
            .ok_or_else(|| CubinError(format!("section {i} past the end")))
    }

    fn section_named(&self, name: &str) -> Result<Option<&'a [u8]>, CubinError> {
        for (i, s) in self.sections.iter().enumerate() {
            if c_str(self.names, s.0 as usize)? == name {
                return self.section_bytes(i).map(Some);
            }
        }
        Ok(None)
    }

    /// The symbol table and the string table its names point into.
    fn symbol_table(&self) -> Result<(&'a [u8], &'a [u8]), CubinError> {
        let i = self
            .sections
            .iter()
            .position(|s| s.1 == SHT_SYMTAB)
            .ok_or_else(|| CubinError("no symbol table".into()))?;
        Ok((
            self.section_bytes(i)?,
            self.section_bytes(self.sections[i].4 as usize)?,
        ))
    }
}

fn c_str(table: &[u8], at: usize) -> Result<&str, CubinError> {
    let rest = table
        .get(at..)
        .ok_or_else(|| CubinError(format!("string at {at} past its table")))?;
    let end = rest
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| CubinError(format!("string at {at} not terminated")))?;
    std::str::from_utf8(&rest[..end]).map_err(|_| CubinError(format!("string at {at} not UTF-8")))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, CubinError> {
    Ok(u16::from_le_bytes(field(b, at)?))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, CubinError> {
    Ok(u32::from_le_bytes(field(b, at)?))
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, CubinError> {
    Ok(u64::from_le_bytes(field(b, at)?))
}

fn field<const N: usize>(b: &[u8], at: usize) -> Result<[u8; N], CubinError> {
    b.get(at..at + N)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| CubinError(format!("{N}-byte field at {at} past the end")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC 13.5's log for two kernels, sm_90, with a non-inlined device function between
    /// them and a report in the older style (no barriers, a cmem entry).
    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'big' for 'sm_90'
ptxas info    : Function properties for big
ptxas         .     200 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers
ptxas info    : Compile time = 23.663 ms
ptxas info    : Function properties for helper
ptxas         .     48 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'add' for 'sm_90'
ptxas info    : Function properties for add
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compile time = 4.811 ms
ptxas info    : Compiling entry function 'old' for 'sm_80'
ptxas info    : Function properties for old
ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 24 registers, 512 bytes smem, 360 bytes cmem[0]
";

    #[test]
    fn reads_the_ptxas_report() {
        let k = parse_ptxas_report(LOG);
        assert_eq!(
            k,
            vec![
                KernelResources {
                    name: "big".into(),
                    registers: 255,
                    barriers: 0,
                    spill_stores: 8,
                    spill_loads: 12,
                    shared_bytes: 0,
                    local_bytes: 200,
                },
                KernelResources {
                    name: "add".into(),
                    registers: 10,
                    barriers: 1,
                    spill_stores: 0,
                    spill_loads: 0,
                    shared_bytes: 1024,
                    local_bytes: 0,
                },
                KernelResources {
                    name: "old".into(),
                    registers: 24,
                    barriers: 0,
                    spill_stores: 0,
                    spill_loads: 0,
                    shared_bytes: 512,
                    local_bytes: 16,
                },
            ]
        );
        assert!(k[0].spills() && !k[1].spills());
        assert!(parse_ptxas_report("").is_empty());
        assert!(parse_ptxas_report("t.cu(3): error: expected a \";\"").is_empty());
    }

    #[test]
    fn refuses_what_is_not_a_cubin() {
        assert!(cubin_entries(b"").is_err());
        assert!(cubin_entries(
            b"// PTX text, not a cubin ..........................................."
        )
        .is_err());
        let mut header = vec![0u8; 64];
        header[..6].copy_from_slice(b"\x7fELF\x02\x01");
        header[0x28] = 0xff; // section headers far past the end
        header[0x3a] = 64;
        header[0x3c] = 3;
        assert!(cubin_entries(&header).is_err());
    }
}
