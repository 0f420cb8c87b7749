//! Tiny argument helpers shared by the subcommands.

use crate::parse::parse_size;

/// A cursor over command-line arguments with `--flag value` / `--flag=value` / `-fVALUE`
/// handling and errors that name the flag.
pub struct Args<'a> {
    args: &'a [String],
    pos: usize,
    /// Value glued to the current flag (`--x=3`, `-n4`), if any.
    glued: Option<String>,
}

impl<'a> Args<'a> {
    pub fn new(args: &'a [String]) -> Args<'a> {
        Args {
            args,
            pos: 0,
            glued: None,
        }
    }

    /// The next argument, split as flag (and glued value) when it looks like one.
    /// `short` lists single-letter flags that take a value, for `-n4` style.
    pub fn next_flag(&mut self, short: &str) -> Option<String> {
        let a = self.args.get(self.pos)?.clone();
        self.pos += 1;
        self.glued = None;
        if let Some(rest) = a.strip_prefix("--") {
            if let Some((k, v)) = rest.split_once('=') {
                self.glued = Some(v.to_string());
                return Some(format!("--{k}"));
            }
            return Some(a);
        }
        if a.len() > 2 && a.starts_with('-') && !a.starts_with("--") {
            let c = &a[1..2];
            if short.contains(c) {
                self.glued = Some(a[2..].to_string());
                return Some(format!("-{c}"));
            }
        }
        Some(a)
    }

    /// The value of the flag just returned by `next_flag`.
    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        if let Some(v) = self.glued.take() {
            return Ok(v);
        }
        let v = self
            .args
            .get(self.pos)
            .cloned()
            .ok_or_else(|| format!("{flag} needs a value"))?;
        self.pos += 1;
        Ok(v)
    }

    pub fn value_parsed<T: std::str::FromStr>(&mut self, flag: &str) -> Result<T, String> {
        let v = self.value(flag)?;
        v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
    }

    pub fn value_size(&mut self, flag: &str) -> Result<usize, String> {
        let v = self.value(flag)?;
        parse_size(&v).ok_or_else(|| format!("{flag}: {v:?} is not a size (e.g. 8, 1K, 64M, 1G)"))
    }

    /// Everything not consumed yet.
    pub fn rest(&self) -> &'a [String] {
        &self.args[self.pos.min(self.args.len())..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_values() {
        let v: Vec<String> = ["-n4", "--iters=3", "-b", "1K", "--", "prog"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut a = Args::new(&v);
        assert_eq!(a.next_flag("nbe").as_deref(), Some("-n"));
        assert_eq!(a.value("-n").unwrap(), "4");
        assert_eq!(a.next_flag("nbe").as_deref(), Some("--iters"));
        assert_eq!(a.value_parsed::<usize>("--iters").unwrap(), 3);
        assert_eq!(a.next_flag("nbe").as_deref(), Some("-b"));
        assert_eq!(a.value_size("-b").unwrap(), 1024);
        assert_eq!(a.next_flag("nbe").as_deref(), Some("--"));
        assert_eq!(a.rest(), &["prog".to_string()]);
    }
}
