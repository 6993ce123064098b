// json.hpp: a small JSON reader for the golden vectors (written for this example).
// Parses RFC 8259 JSON into a tree of Value; numbers keep their text so integers
// convert exactly. No dependencies beyond the C++17 standard library.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mini_json {

struct Value {
    enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
    bool b = false;
    std::string text;                    // Number: the literal; String: the decoded string
    std::vector<Value> items;            // Array
    std::map<std::string, Value> fields; // Object (the vectors' keys are sorted anyway)

    bool is_null() const { return kind == Null; }
    bool has(const std::string& k) const { return kind == Object && fields.count(k) != 0; }
    const Value& operator[](const std::string& k) const {
        auto it = fields.find(k);
        if (kind != Object || it == fields.end()) throw std::runtime_error("json: no field '" + k + "'");
        return it->second;
    }
    const Value& operator[](size_t i) const {
        if (kind != Array || i >= items.size()) throw std::runtime_error("json: index out of range");
        return items[i];
    }
    size_t size() const { return kind == Array ? items.size() : fields.size(); }
    int64_t as_int() const {
        if (kind != Number) throw std::runtime_error("json: not a number");
        return std::strtoll(text.c_str(), nullptr, 10);
    }
    uint64_t as_u64() const {
        if (kind != Number) throw std::runtime_error("json: not a number");
        return std::strtoull(text.c_str(), nullptr, 10);
    }
    double as_double() const {
        if (kind != Number) throw std::runtime_error("json: not a number");
        return std::strtod(text.c_str(), nullptr);
    }
    const std::string& as_string() const {
        if (kind != String) throw std::runtime_error("json: not a string");
        return text;
    }
    std::vector<int64_t> as_ints() const {
        std::vector<int64_t> out;
        for (const Value& v : items) out.push_back(v.as_int());
        return out;
    }
};

class Parser {
  public:
    explicit Parser(const std::string& s) : s_(s) {}
    Value parse() {
        Value v = value();
        ws();
        if (i_ != s_.size()) fail("trailing characters");
        return v;
    }

  private:
    const std::string& s_;
    size_t i_ = 0;

    [[noreturn]] void fail(const char* what) const {
        throw std::runtime_error(std::string("json: ") + what + " at offset " + std::to_string(i_));
    }
    void ws() {
        while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
    }
    bool eat(const char* lit) {
        size_t n = std::char_traits<char>::length(lit);
        if (s_.compare(i_, n, lit) == 0) { i_ += n; return true; }
        return false;
    }
    Value value() {
        ws();
        if (i_ >= s_.size()) fail("unexpected end");
        Value v;
        char c = s_[i_];
        if (c == '{') {
            v.kind = Value::Object; ++i_; ws();
            if (s_[i_] == '}') { ++i_; return v; }
            for (;;) {
                ws();
                if (s_[i_] != '"') fail("expected a key");
                std::string k = string();
                ws();
                if (s_[i_++] != ':') fail("expected ':'");
                v.fields[k] = value();
                ws();
                if (s_[i_] == ',') { ++i_; continue; }
                if (s_[i_] == '}') { ++i_; return v; }
                fail("expected ',' or '}'");
            }
        }
        if (c == '[') {
            v.kind = Value::Array; ++i_; ws();
            if (s_[i_] == ']') { ++i_; return v; }
            for (;;) {
                v.items.push_back(value());
                ws();
                if (s_[i_] == ',') { ++i_; continue; }
                if (s_[i_] == ']') { ++i_; return v; }
                fail("expected ',' or ']'");
            }
        }
        if (c == '"') { v.kind = Value::String; v.text = string(); return v; }
        if (eat("true")) { v.kind = Value::Bool; v.b = true; return v; }
        if (eat("false")) { v.kind = Value::Bool; return v; }
        if (eat("null")) return v;
        size_t start = i_;
        if (s_[i_] == '-') ++i_;
        while (i_ < s_.size() && (isdigit((unsigned char)s_[i_]) || s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E' ||
                                  s_[i_] == '+' || s_[i_] == '-'))
            ++i_;
        if (start == i_) fail("unexpected character");
        v.kind = Value::Number;
        v.text = s_.substr(start, i_ - start);
        return v;
    }
    static void utf8(std::string& out, uint32_t cp) {
        if (cp < 0x80) out += char(cp);
        else if (cp < 0x800) { out += char(0xC0 | (cp >> 6)); out += char(0x80 | (cp & 0x3F)); }
        else if (cp < 0x10000) { out += char(0xE0 | (cp >> 12)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
        else { out += char(0xF0 | (cp >> 18)); out += char(0x80 | ((cp >> 12) & 0x3F)); out += char(0x80 | ((cp >> 6) & 0x3F)); out += char(0x80 | (cp & 0x3F)); }
    }
    uint32_t hex4() {
        if (i_ + 4 > s_.size()) fail("short \\u escape");
        uint32_t cp = std::stoul(s_.substr(i_, 4), nullptr, 16);
        i_ += 4;
        return cp;
    }
    std::string string() {
        ++i_;  // opening quote
        std::string out;
        while (i_ < s_.size() && s_[i_] != '"') {
            char c = s_[i_++];
            if (c != '\\') { out += c; continue; }
            char e = s_[i_++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    uint32_t cp = hex4();
                    if (cp >= 0xD800 && cp < 0xDC00 && eat("\\u")) cp = 0x10000 + ((cp - 0xD800) << 10) + (hex4() - 0xDC00);
                    utf8(out, cp);
                    break;
                }
                default: fail("bad escape");
            }
        }
        if (i_ >= s_.size()) fail("unterminated string");
        ++i_;
        return out;
    }
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace mini_json
