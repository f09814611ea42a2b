//! Text → syntax tree. The only module that looks at pest's `Rule`s.

use pest::Parser;
use pest::error::{ErrorVariant, InputLocation};
use pest::iterators::Pair;

use ir::{DType, Dim, Span, TensorType, Type};

use crate::ast::*;
use crate::diag::Diagnostic;

#[allow(missing_docs)]
mod grammar {
    #[derive(pest_derive::Parser)]
    #[grammar = "grammar.pest"]
    pub(super) struct OnnxText;
}
use grammar::{OnnxText, Rule};

/// The deepest bracket nesting accepted; deeper input is rejected before pest sees it, so that
/// no input can exhaust the stack.
pub const MAX_NESTING: usize = 128;

fn span_of(p: &Pair<'_, Rule>) -> Span {
    let s = p.as_span();
    Span::new(s.start(), s.end())
}

/// Parses a whole model.
pub fn parse_model(source: &str) -> Result<Model, Diagnostic> {
    check_nesting(source)?;
    let mut pairs = match OnnxText::parse(Rule::model, source) {
        Ok(p) => p,
        Err(e) => return Err(syntax_error(source, e)),
    };
    let model = pairs.next().expect("the model rule produces one pair");
    build_model(model)
}

/// Rejects input nested deeper than [`MAX_NESTING`] (counting `(`, `[`, `{`, `<` outside
/// strings and comments), before the recursive parser runs.
fn check_nesting(source: &str) -> Result<(), Diagnostic> {
    let bytes = source.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'(' | b'[' | b'{' | b'<' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(Diagnostic::error(format!("brackets are nested more than {MAX_NESTING} deep"))
                        .with_primary(Span::new(i, i + 1), "too deep")
                        .with_note("real models nest a few levels; this input is probably damaged"));
                }
            }
            // `=>` (a graph's signature arrow) closes nothing.
            b'>' if i > 0 && bytes[i - 1] == b'=' => {}
            b')' | b']' | b'}' | b'>' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

fn rule_name(r: Rule) -> Option<&'static str> {
    Some(match r {
        Rule::ident | Rule::dotted_id => "a name",
        Rule::string_lit | Rule::string_inner => "a string",
        Rule::int_lit => "an integer",
        Rule::float_lit | Rule::special_float => "a number",
        Rule::prim_type | Rule::type_ | Rule::tensor_type | Rule::type_value => "a type",
        Rule::graph => "a graph",
        Rule::node => "a node",
        Rule::attr => "an attribute",
        Rule::header | Rule::header_item => "a header entry",
        Rule::dim | Rule::unknown_dim => "a dimension",
        Rule::value_info | Rule::input_item => "a value (`type name`)",
        Rule::tensor_const => "a tensor constant",
        Rule::inline_data => "`{`",
        Rule::external_data => "`[`",
        Rule::function => "a function",
        Rule::EOI => "end of input",
        Rule::attr_ref => "`@`",
        Rule::label => "`[`",
        Rule::op_name => "an operator name",
        Rule::input_list | Rule::output_list | Rule::fn_io => "`(`",
        Rule::init_list | Rule::attr_list | Rule::fn_attrs | Rule::fn_vi => "`<`",
        Rule::node_list => "`{`",
        Rule::kv_list | Rule::value_list | Rule::shape => "`[`",
        Rule::overload => "`:`",
        _ => return None,
    })
}

/// What sits at `pos`, for "found …".
fn describe_at(source: &str, pos: usize) -> String {
    let rest = &source[pos.min(source.len())..];
    let Some(c) = rest.chars().next() else {
        return "end of file".into();
    };
    if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
        let word: String =
            rest.chars().take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')).take(40).collect();
        format!("`{word}`")
    } else if c == '"' {
        "a string".into()
    } else if c.is_control() {
        format!("the control character U+{:04X}", u32::from(c))
    } else {
        format!("`{c}`")
    }
}

/// Where a string literal starting at `pos` ends, if it does.
fn string_end(source: &str, pos: usize) -> Option<usize> {
    let bytes = source.as_bytes();
    let mut i = pos + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

fn syntax_error(source: &str, e: pest::error::Error<Rule>) -> Diagnostic {
    let mut pos = match e.location {
        InputLocation::Pos(p) => p,
        InputLocation::Span((s, _)) => s,
    };
    if let ErrorVariant::CustomError { message } = &e.variant {
        let end = (pos + 1).min(source.len());
        return Diagnostic::error(format!("cannot parse this input: {message}"))
            .with_primary(Span::new(pos, end), "here");
    }
    // pest's default position is the furthest *rule* attempt; with error detail it also
    // tracks literal tokens, which finds the real spot (a missing `)` after the last input).
    pest::set_error_detail(true);
    let detailed = OnnxText::parse(Rule::model, source).err();
    pest::set_error_detail(false);
    let attempts = detailed.as_ref().and_then(|d| d.parse_attempts());
    let mut expected: Vec<String> = Vec::new();
    let mut push = |s: String| {
        if !expected.contains(&s) {
            expected.push(s);
        }
    };
    let mut rules: Vec<Rule> = Vec::new();
    if let Some(a) = &attempts
        && a.max_position >= pos
    {
        pos = a.max_position;
        for t in a.expected_tokens() {
            // `ParsingToken` is not exported; its Display is the token itself.
            let token = t.to_string();
            if matches!(
                token.as_str(),
                "(" | ")" | "[" | "]" | "{" | "}" | "<" | ">" | "," | ":" | "=" | "=>" | "@" | "?" | "."
            ) {
                push(format!("`{token}`"));
            }
        }
        for stack in a.call_stacks() {
            rules.push(stack.deepest.get_rule().copied().unwrap_or(Rule::EOI));
        }
    } else if let ErrorVariant::ParsingError { positives, .. } = &e.variant {
        rules.extend(positives.iter().copied());
    }
    for r in rules {
        if let Some(n) = rule_name(r) {
            push(n.to_string());
        }
    }
    // An unterminated string swallows the rest of the file; say so where it starts.
    let mut in_string = None;
    let mut i = 0;
    let bytes = source.as_bytes();
    while i < bytes.len() && i <= pos {
        match bytes[i] {
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' => match string_end(source, i) {
                Some(e) => i = e,
                None => {
                    in_string = Some(i);
                    break;
                }
            },
            _ => i += 1,
        }
    }
    if let Some(start) = in_string {
        return Diagnostic::error("unterminated string literal")
            .with_primary(Span::new(start, start + 1), "this string is never closed")
            .with_note("strings end with an unescaped `\"`; write `\\\"` for a quote inside a string");
    }
    let what = match expected.len() {
        0 => "unexpected input".to_string(),
        1 => format!("expected {}", expected[0]),
        n => format!("expected {} or {}", expected[..n - 1].join(", "), expected[n - 1]),
    };
    let found = describe_at(source, pos);
    let end = source[pos.min(source.len())..].chars().next().map_or(pos, |c| pos + c.len_utf8());
    let label = if pos >= source.len() { "the input ends here".to_string() } else { format!("found {found}") };
    let mut d =
        Diagnostic::error(format!("syntax error: {what}, found {found}")).with_primary(Span::new(pos, end), label);
    if pos >= source.len() {
        d = d.with_note("the file may be truncated");
    }
    d
}

// ---------------------------------------------------------------- tree building

fn build_model(p: Pair<'_, Rule>) -> Result<Model, Diagnostic> {
    let mut header = None;
    let mut graph = None;
    let mut functions = Vec::new();
    for c in p.into_inner() {
        match c.as_rule() {
            Rule::header => header = Some(build_header(c)?),
            Rule::graph => graph = Some(build_graph(c)?),
            Rule::function => functions.push(build_function(c)?),
            Rule::EOI => {}
            r => unreachable!("unexpected {r:?} in model"),
        }
    }
    Ok(Model { header, graph: graph.expect("the grammar requires a graph"), functions })
}

fn build_header(p: Pair<'_, Rule>) -> Result<Vec<HeaderItem>, Diagnostic> {
    p.into_inner()
        .map(|item| {
            let span = span_of(&item);
            let mut it = item.into_inner();
            let key = it.next().expect("key");
            let key = Spanned { node: key.as_str().to_string(), span: span_of(&key) };
            let v = it.next().expect("value");
            let value = match v.as_rule() {
                Rule::kv_list => {
                    let vspan = span_of(&v);
                    let pairs = v
                        .into_inner()
                        .map(|kv| {
                            let mut k = kv.into_inner();
                            let key = k.next().expect("key");
                            let key = Spanned { node: unescape(key.clone()), span: span_of(&key) };
                            let val = literal(k.next().expect("value"));
                            (key, val)
                        })
                        .collect();
                    HeaderValue::Pairs(pairs, vspan)
                }
                _ => HeaderValue::Literal(literal(v)),
            };
            Ok(HeaderItem { key, value, span })
        })
        .collect()
}

fn unescape(p: Pair<'_, Rule>) -> String {
    debug_assert_eq!(p.as_rule(), Rule::string_lit);
    // The literal without its quotes (both one byte), read without walking the pairs.
    let s = p.as_str();
    let inner = s.get(1..s.len().saturating_sub(1)).unwrap_or("");
    if !inner.contains('\\') {
        return inner.to_string();
    }
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn name(p: Pair<'_, Rule>) -> Spanned<String> {
    let span = span_of(&p);
    let node = match p.as_rule() {
        Rule::string_lit => unescape(p),
        _ => p.as_str().to_string(),
    };
    Spanned { node, span }
}

fn literal(p: Pair<'_, Rule>) -> Literal {
    let span = span_of(&p);
    let node = match p.as_rule() {
        Rule::int_lit => LiteralKind::Int(p.as_str().to_string()),
        Rule::float_lit | Rule::special_float => LiteralKind::Float(p.as_str().to_string()),
        Rule::string_lit => LiteralKind::Str(unescape(p)),
        r => unreachable!("{r:?} is not a literal"),
    };
    Spanned { node, span }
}

fn build_type(p: Pair<'_, Rule>) -> Result<TypeAst, Diagnostic> {
    let span = span_of(&p);
    let inner = if p.as_rule() == Rule::type_ { p.into_inner().next().expect("type body") } else { p };
    let ty = match inner.as_rule() {
        Rule::tensor_type => Type::Tensor(tensor_type(inner)?),
        Rule::sparse_type => Type::SparseTensor(tensor_type(inner)?),
        Rule::seq_type => Type::Seq(Box::new(build_type(inner.into_inner().next().expect("elem"))?.ty)),
        Rule::optional_type => Type::Optional(Box::new(build_type(inner.into_inner().next().expect("elem"))?.ty)),
        Rule::map_type => {
            let mut it = inner.into_inner();
            let key = DType::from_name(it.next().expect("key").as_str()).expect("grammar lists dtypes");
            Type::Map(key, Box::new(build_type(it.next().expect("value"))?.ty))
        }
        Rule::opaque_type => {
            let mut it = inner.into_inner();
            let (domain, name) = match (it.next(), it.next()) {
                (Some(a), Some(b)) => (a.as_str().to_string(), b.as_str().to_string()),
                (Some(a), None) => (String::new(), a.as_str().to_string()),
                _ => (String::new(), String::new()),
            };
            Type::Opaque { domain, name }
        }
        r => unreachable!("{r:?} is not a type"),
    };
    Ok(TypeAst { ty, span })
}

fn tensor_type(p: Pair<'_, Rule>) -> Result<TensorType, Diagnostic> {
    let mut it = p.into_inner();
    let dtype = DType::from_name(it.next().expect("dtype").as_str()).expect("grammar lists dtypes");
    let dims = match it.next() {
        None => Some(vec![]),
        Some(shape) => {
            let dims: Vec<_> = shape.into_inner().map(build_dim).collect::<Result<_, _>>()?;
            if dims.is_empty() { None } else { Some(dims) }
        }
    };
    Ok(TensorType { dtype, dims })
}

fn build_dim(p: Pair<'_, Rule>) -> Result<Dim, Diagnostic> {
    let d = p.into_inner().next().expect("dim body");
    Ok(match d.as_rule() {
        Rule::unknown_dim => Dim::Unknown,
        Rule::int_lit => {
            let span = span_of(&d);
            Dim::Fixed(d.as_str().parse().map_err(|_| {
                Diagnostic::error("dimension out of range").with_primary(span, "does not fit in a 64-bit integer")
            })?)
        }
        Rule::ident => Dim::Sym(d.as_str().to_string()),
        Rule::string_lit => Dim::Sym(unescape(d)),
        r => unreachable!("{r:?} is not a dim"),
    })
}

fn value_info(p: Pair<'_, Rule>) -> Result<ValueInfo, Diagnostic> {
    let mut ty = None;
    let mut nm = None;
    for c in p.into_inner() {
        match c.as_rule() {
            Rule::type_ => ty = Some(build_type(c)?),
            _ => nm = Some(name(c)),
        }
    }
    Ok(ValueInfo { ty, name: nm.expect("value info has a name") })
}

fn data(p: Pair<'_, Rule>) -> Data {
    let span = span_of(&p);
    match p.as_rule() {
        Rule::inline_data => Data::Inline(p.into_inner().map(literal).collect(), span),
        Rule::external_data => Data::External(
            p.into_inner()
                .map(|kv| {
                    let mut it = kv.into_inner();
                    (unescape(it.next().expect("key")), unescape(it.next().expect("value")))
                })
                .collect(),
            span,
        ),
        r => unreachable!("{r:?} is not tensor data"),
    }
}

fn entry(p: Pair<'_, Rule>) -> Result<Entry, Diagnostic> {
    let span = span_of(&p);
    let mut it = p.into_inner();
    let info = value_info(it.next().expect("value info"))?;
    let data = it.next().map(data);
    Ok(Entry { info, data, span })
}

fn build_graph(p: Pair<'_, Rule>) -> Result<Graph, Diagnostic> {
    let span = span_of(&p);
    let mut it = p.into_inner();
    let gname = name(it.next().expect("graph name"));
    let inputs = it.next().expect("inputs").into_inner().map(entry).collect::<Result<_, _>>()?;
    let outputs = it.next().expect("outputs").into_inner().map(value_info).collect::<Result<_, _>>()?;
    let mut inits = Vec::new();
    let mut nodes = Vec::new();
    for c in it {
        match c.as_rule() {
            Rule::init_list => inits = c.into_inner().map(entry).collect::<Result<_, _>>()?,
            Rule::node_list => nodes = c.into_inner().map(build_node).collect::<Result<_, _>>()?,
            r => unreachable!("{r:?} in graph"),
        }
    }
    Ok(Graph { name: gname, inputs, outputs, inits, nodes, span })
}

/// ONNX's id-list rules: `()` is empty, `(,x)` has an empty first item, a trailing comma adds
/// nothing.
fn id_list(p: Pair<'_, Rule>) -> Vec<Option<Spanned<String>>> {
    let mut items: Vec<Option<Spanned<String>>> = p.into_inner().map(|opt| opt.into_inner().next().map(name)).collect();
    if items.len() == 1 && items[0].is_none() {
        items.clear();
    } else if items.len() > 1 && items.last().is_some_and(Option::is_none) {
        items.pop();
    }
    items
}

/// The span of a node without the whitespace and comments pest lets it swallow at its end:
/// it ends at the `)` closing its inputs, or at the `>` of attributes written after them.
fn node_span(p: &Pair<'_, Rule>) -> Span {
    let whole = p.as_span();
    let src = whole.get_input();
    let last = p.clone().into_inner().last();
    let end = match last {
        Some(l) if l.as_rule() == Rule::attr_list => l.as_span().end(),
        Some(l) => {
            // Skip whitespace and comments after the inputs, then take the `)`.
            let bytes = src.as_bytes();
            let mut i = l.as_span().end();
            while i < whole.end() {
                match bytes[i] {
                    b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c => i += 1,
                    b'#' => {
                        while i < whole.end() && bytes[i] != b'\n' {
                            i += 1;
                        }
                    }
                    b')' => {
                        i += 1;
                        break;
                    }
                    _ => break,
                }
            }
            i
        }
        None => whole.end(),
    };
    Span::new(whole.start(), end.max(whole.start()))
}

fn build_node(p: Pair<'_, Rule>) -> Result<Node, Diagnostic> {
    let span = node_span(&p);
    let mut label = None;
    let mut outputs = None;
    let mut inputs = None;
    let mut domain = String::new();
    let mut op_type = None;
    let mut overload = None;
    let mut attrs = Vec::new();
    for c in p.into_inner() {
        match c.as_rule() {
            Rule::label => {
                let inner = c.into_inner().next();
                label = Some(inner.map(name).unwrap_or(Spanned { node: String::new(), span }));
            }
            Rule::id_list if outputs.is_none() => outputs = Some(id_list(c)),
            Rule::id_list => inputs = Some(id_list(c)),
            Rule::op_name => {
                let parts: Vec<Pair<'_, Rule>> = c.into_inner().collect();
                let (last, prefix) = parts.split_last().expect("op name has an identifier");
                domain = prefix.iter().map(|p| p.as_str()).collect::<Vec<_>>().join(".");
                op_type = Some(Spanned { node: last.as_str().to_string(), span: span_of(last) });
            }
            Rule::overload => overload = Some(c.into_inner().next().expect("overload").as_str().to_string()),
            Rule::attr_list => {
                for a in c.into_inner() {
                    attrs.push(build_attr(a)?);
                }
            }
            r => unreachable!("{r:?} in node"),
        }
    }
    Ok(Node {
        label,
        outputs: outputs.unwrap_or_default(),
        domain,
        op_type: op_type.expect("node has an op"),
        overload,
        attrs,
        inputs: inputs.unwrap_or_default(),
        span,
    })
}

fn build_attr(p: Pair<'_, Rule>) -> Result<Attr, Diagnostic> {
    let span = span_of(&p);
    let mut it = p.into_inner().peekable();
    let aname = name(it.next().expect("attribute name"));
    let kind = match it.peek().map(|c| c.as_rule()) {
        Some(Rule::ident) => Some(name(it.next().expect("peeked"))),
        _ => None,
    };
    let v = it.next().expect("attribute value");
    let value = match v.as_rule() {
        Rule::value_list => {
            let vspan = span_of(&v);
            AttrValue::List(v.into_inner().map(single).collect::<Result<_, _>>()?, vspan)
        }
        _ => AttrValue::Single(single(v)?),
    };
    Ok(Attr { name: aname, kind, value, span })
}

fn single(p: Pair<'_, Rule>) -> Result<Single, Diagnostic> {
    let span = span_of(&p);
    Ok(match p.as_rule() {
        Rule::attr_ref => Single::Ref(name(p.into_inner().next().expect("ref name"))),
        Rule::tensor_const => {
            let mut ty = None;
            let mut tname = None;
            let mut tdata = None;
            for c in p.into_inner() {
                match c.as_rule() {
                    Rule::type_ => ty = Some(build_type(c)?),
                    Rule::ident | Rule::string_lit => tname = Some(name(c).node),
                    Rule::inline_data | Rule::external_data => tdata = Some(data(c)),
                    r => unreachable!("{r:?} in tensor constant"),
                }
            }
            Single::Tensor { ty: ty.expect("type"), name: tname, data: tdata.expect("data"), span }
        }
        Rule::type_value => Single::Type(build_type(p.into_inner().next().expect("type"))?),
        Rule::graph => Single::Graph(Box::new(build_graph(p)?)),
        Rule::int_lit | Rule::float_lit | Rule::special_float | Rule::string_lit => Single::Literal(literal(p)),
        r => unreachable!("{r:?} as attribute value"),
    })
}

fn build_function(p: Pair<'_, Rule>) -> Result<Function, Diagnostic> {
    let span = span_of(&p);
    let mut header = None;
    let mut fname = None;
    let mut attr_params = Vec::new();
    let mut attr_defaults = Vec::new();
    let mut ios = Vec::new();
    let mut value_infos = Vec::new();
    let mut nodes = Vec::new();
    for c in p.into_inner() {
        match c.as_rule() {
            Rule::header => header = Some(build_header(c)?),
            Rule::ident | Rule::string_lit => fname = Some(name(c)),
            Rule::fn_attrs => {
                for a in c.into_inner() {
                    match a.as_rule() {
                        Rule::attr => attr_defaults.push(build_attr(a)?),
                        _ => attr_params.push(name(a)),
                    }
                }
            }
            Rule::fn_io => ios.push(c.into_inner().map(value_info).collect::<Result<Vec<_>, _>>()?),
            Rule::fn_vi => value_infos = c.into_inner().map(value_info).collect::<Result<_, _>>()?,
            Rule::node_list => nodes = c.into_inner().map(build_node).collect::<Result<_, _>>()?,
            r => unreachable!("{r:?} in function"),
        }
    }
    let mut ios = ios.into_iter();
    Ok(Function {
        header,
        name: fname.expect("function name"),
        attr_params,
        attr_defaults,
        inputs: ios.next().unwrap_or_default(),
        outputs: ios.next().unwrap_or_default(),
        value_infos,
        nodes,
        span,
    })
}
